"""The grouped (ragged_dot) expert path that accelerators take, run on CPU: parity and sharded equality; the
CPU expert forms against it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import load_pretrained
from ernie_jax.ops.dense import swiglu
from ernie_jax.ops.routed_experts import ExpertOptions, expert_capacities, routed_experts
from ernie_jax.sharding import ShardingPlan, make_mesh
from tests.conftest import GOLDEN


def with_experts(model, implementation: str):
    """model running its routed experts as `implementation` (the execution config is part of the jit key)."""
    model.execution = dataclasses.replace(model.execution, routed_experts=implementation)
    return model


@pytest.mark.parametrize("name", ["shared_untied", "noshared_tied"])
def test_ragged_path_matches_hf(golden, name):
    g = golden(name)
    out = with_experts(load_pretrained(GOLDEN / name / "paddle", dtype=jnp.float32), "ragged").forward(g["input_ids"])
    assert np.abs(np.asarray(out.logits) - g["logits"]).max() < 1e-4
    ids = np.concatenate([np.sort(np.asarray(e), axis=-1) for e in out.expert_ids], axis=0)
    np.testing.assert_array_equal(ids, g["topk_experts"])


@pytest.mark.parametrize("mesh", ["data=1,expert=8,tensor=1", "data=2,expert=2,tensor=2"])
def test_ragged_expert_parallel_matches(golden, mesh):
    g = golden("shared_untied")
    model = with_experts(load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32), "ragged")
    sharded = model.shard(ShardingPlan.create(make_mesh(mesh)))
    assert np.abs(np.asarray(sharded(g["input_ids"])) - g["logits"]).max() < 1e-4


def test_ragged_fp8_grouped_path_matches_capacity_path(golden):
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8",
                            fp8_compute="weight_only")
    ragged_logits = np.asarray(with_experts(model, "ragged")(g["input_ids"]))
    capacity_ref = np.asarray(with_experts(model, "capacity")(g["input_ids"]))
    assert np.abs(ragged_logits - capacity_ref).max() < 1e-4


@pytest.mark.parametrize("midpoints", [True, False])
def test_expert_capacities_cover_every_load(midpoints):
    for tokens, k, experts in [(16, 4, 16), (128, 8, 64), (1, 8, 64), (7, 2, 8), (3, 2, 2), (100, 1, 64)]:
        caps = expert_capacities(tokens, k, experts, midpoints)
        assert caps == sorted(set(caps)) and caps[-1] == tokens  # no expert can get more than `tokens` rows
        assert caps[0] >= min(-(-tokens * k // experts), tokens)  # nothing below the mean load
    assert expert_capacities(16, 4, 16, midpoints) == ([4, 8, 12, 16] if midpoints else [4, 8, 16])
    assert expert_capacities(64, 4, 16, midpoints) == ([16, 24, 32, 48, 64] if midpoints else [16, 32, 64])


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("skew", [False, True], ids=["random", "skewed"])
@pytest.mark.parametrize("first, local", [(0, 8), (2, 2), (6, 2)])
def test_cpu_paths_match_ragged_path(skew, first, local, groups):
    """The CPU capacity and tiled formulations against the grouped-matmul one, for all experts and for a
    device's slice of them (expert parallelism), with routing spread out and with every token on the same
    two experts (the largest capacity is taken: nothing is dropped; tiles run past their expert's rows),
    with the experts stacked and split in groups (weights.cpu_layout)."""
    opts = ExpertOptions(tile_rows=4, sorted_tile_rows=4)  # several tiles per expert, and partial ones
    T, H, F, E, k = 19, 32, 16, 8, 2
    key = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(key[0], (T, H))
    up_gate = jax.random.normal(key[1], (E, H, 2 * F)) * 0.2
    down = jax.random.normal(key[2], (E, F, H)) * 0.2
    pick = jax.vmap(lambda kk: jax.random.choice(kk, E, (k,), replace=False))
    ids = jnp.tile(jnp.array([[first, first + 1]], jnp.int32), (T, 1)) if skew else \
        pick(jax.random.split(key[3], T)).astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(key[3], (T, k)), axis=-1)
    ug, dn = up_gate[first:first + local], down[first:first + local]
    if groups > 1:
        n = local // groups
        ug, dn = (tuple(a[g * n:(g + 1) * n] for g in range(groups)) for a in (ug, dn))
    out = {}
    for impl in ("capacity", "tiled", "sorted_tiles", "ragged"):
        out[impl] = np.asarray(jax.jit(lambda *a, _impl=impl: routed_experts(*a, E, first, implementation=_impl,
                                                                             opts=opts))(x, w, ids, ug, dn))
    # reference: each assignment to a local expert, one at a time
    ref = np.zeros((T, H), np.float32)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if first <= e < first + local:
                ref[t] += float(w[t, j]) * np.asarray(swiglu(x[t:t + 1], up_gate[e], down[e]))[0]
    for impl, got in out.items():
        np.testing.assert_allclose(got, ref, atol=1e-5, err_msg=impl)
    invariant = jax.jit(lambda *a: routed_experts(*a, E, first, batch_invariant=True, implementation="capacity"))(
        x, w, ids, ug, dn)
    np.testing.assert_allclose(np.asarray(invariant), ref, atol=1e-5)


@pytest.mark.parametrize("impl", ["capacity", "tiled", "sorted_tiles", "xla_cpu", "cpu_matvec", "ragged"])
def test_padding_rows_cost_no_expert_work(impl):
    """valid=False rows (padding) go to no expert, so their routed output is 0 and the real rows' are unchanged;
    "ragged" computes every row. cpu_matvec takes bf16 experts (f32 ones run the xla_cpu forms)."""
    opts = ExpertOptions(tile_rows=4, sorted_tile_rows=4)
    T, H, F, E, k = 9, 32, 16, 8, 2
    key = jax.random.split(jax.random.key(1), 4)
    dtype = jnp.bfloat16 if impl == "cpu_matvec" else jnp.float32
    x = jax.random.normal(key[0], (T, H)).astype(dtype)
    ug, dn = (jax.random.normal(kk, shape).astype(dtype) * 0.2 for kk, shape in ((key[1], (E, H, 2 * F)),
                                                                              (key[2], (E, F, H))))
    ids = jax.vmap(lambda kk: jax.random.choice(kk, E, (k,), replace=False))(jax.random.split(key[3], T)).astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(key[3], (T, k)), axis=-1)
    valid = jnp.arange(T) % 3 != 1
    run = lambda v: np.asarray(jax.jit(lambda *a: routed_experts(  # noqa: E731
        *a, E, implementation=impl, opts=opts, valid=v))(x, w, ids, ug, dn), np.float32)
    full, skipped = run(None), run(valid)
    rows = np.asarray(valid)
    np.testing.assert_allclose(skipped[rows], full[rows], atol=1e-5 if dtype == jnp.float32 else 1e-2)
    if impl == "ragged":
        np.testing.assert_allclose(skipped, full, atol=1e-5)
    else:
        assert not skipped[~rows].any() and full[~rows].any()
