"""Sharded execution on 8 fake CPU devices: equality with the unsharded model, dropless EP, placement."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ernie_jax import ErnieConfig, ErnieForCausalLM, load_pretrained
from ernie_jax.model.forward import decoder_layer
from ernie_jax.ops import REFERENCE, ExecutionConfig, Platform
from ernie_jax.model.weights import abstract_weights
from ernie_jax.sharding import MeshError, ShardingError, ShardingPlan, make_mesh
from tests.conftest import GOLDEN

MESHES = ["data=1,expert=8,tensor=1", "data=1,expert=4,tensor=2", "data=2,expert=2,tensor=2",
          "data=1,expert=1,tensor=8"]
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
            moe_layer_start_index=1, tie_word_embeddings=False, num_nextn_predict_layers=0)


@functools.lru_cache(maxsize=None)
def tiny(shared: int) -> ErnieForCausalLM:
    cfg = ErnieConfig(**BASE, moe_num_shared_experts=shared)
    return ErnieForCausalLM(cfg, rngs=nnx.Rngs(shared), dtype=jnp.float32)


def run(model, ids, prefill=5):
    """Full-forward logits, and logits of a prefill + one-token-at-a-time decode through the KV cache."""
    B, T = ids.shape
    full = np.asarray(model(ids))
    out = model.forward(ids[:, :prefill], np.broadcast_to(np.arange(prefill), (B, prefill)),
                        model.init_cache(B, 16))
    steps = [np.asarray(out.logits)]
    for t in range(prefill, T):
        out = model.forward(ids[:, t:t + 1], np.full((B, 1), t), out.cache)
        steps.append(np.asarray(out.logits))
    return full, np.concatenate(steps, axis=1)


@pytest.mark.parametrize("shared", [1, 0], ids=["shared", "noshared"])
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_matches_unsharded(mesh, shared):
    ids = np.random.default_rng(0).integers(3, 256, (2, 9)).astype(np.int32)
    model = tiny(shared)
    ref_full, ref_dec = run(model, ids)
    sharded = model.shard(ShardingPlan.create(make_mesh(mesh)))
    full, dec = run(sharded, ids)
    assert np.abs(full - ref_full).max() < 1e-5
    assert np.abs(dec - ref_dec).max() < 1e-5
    assert np.abs(dec - ref_full).max() < 1e-5


def dispatching(model, dispatch: str = "all_to_all"):
    """model with the expert-parallel dispatch `dispatch` (all_to_all, the GPU/TPU default, runs on CPU
    through its all-gather equivalent); the execution config is part of the jit key."""
    model.execution = dataclasses.replace(model.execution, ep_dispatch=dispatch)
    return model


@pytest.mark.parametrize("preset", ["tp_ep", "dp_attn_ep"])
@pytest.mark.parametrize("mesh", MESHES)
def test_all_to_all_dispatch_matches_unsharded(mesh, preset):
    """Odd token counts (T not a multiple of the expert group) in prefill and in one-token decode steps."""
    ids = np.random.default_rng(3).integers(3, 256, (2, 7)).astype(np.int32)
    ref, _ = run(tiny(1), ids)
    full, dec = run(dispatching(tiny(1).shard(ShardingPlan.create(make_mesh(mesh), preset))), ids)
    assert np.abs(full - ref).max() < 1e-5 and np.abs(dec - ref).max() < 1e-5


def test_all_to_all_worst_case_load_with_padding_tokens():
    """7 tokens on 8 devices (one padding token) all routed to experts 0 and 1: device 0 receives a row from
    every token, the most its receive buffer is sized for (an overflow would turn the output into NaN)."""
    model = tiny(0)
    w = model.weights()
    w["segments"][1]["router_bias"] = w["segments"][1]["router_bias"].at[:, :2].set(10.0)
    skewed = ErnieForCausalLM(model.config, w, dtype=jnp.float32)
    ids = np.random.default_rng(4).integers(3, 256, (1, 7)).astype(np.int32)
    out = np.asarray(dispatching(skewed.shard(ShardingPlan.create(make_mesh("data=1,expert=8,tensor=1"))))(ids))
    assert np.abs(out - np.asarray(skewed(ids))).max() < 1e-5


@pytest.mark.parametrize("preset", ["tp", "dp_attn_ep"])
def test_other_presets(preset):
    ids = np.random.default_rng(1).integers(3, 256, (2, 7)).astype(np.int32)
    ref, _ = run(tiny(1), ids)
    full, dec = run(tiny(1).shard(ShardingPlan.create(make_mesh("data=2,expert=2,tensor=2"), preset)), ids)
    assert np.abs(full - ref).max() < 1e-5 and np.abs(dec - ref).max() < 1e-5


def dense_moe_reference(x, w, cfg):
    """Every expert on every token, weighted by a one-hot of the routing: no sorting, no grouping."""
    from ernie_jax.ops.dense import swiglu
    from ernie_jax.ops.routed_experts import route
    x2 = x.reshape(-1, x.shape[-1])
    weights, ids = route(x2, w["router"], w["router_bias"], cfg.moe_k, cfg.moe_norm_min)
    per_expert = jnp.stack([swiglu(x2, w["experts_up_gate"][e], w["experts_down"][e])
                            for e in range(cfg.moe_num_experts)], axis=1)  # [T,E,H]
    gate = jnp.zeros((x2.shape[0], cfg.moe_num_experts)).at[jnp.arange(x2.shape[0])[:, None], ids].add(weights)
    return jnp.einsum("te,teh->th", gate, per_expert).reshape(x.shape), ids


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
def test_skewed_routing_drops_nothing_under_ep(dispatch):
    """Every token picks experts 0 and 1 (a huge correction bias): those two devices get all the work (with
    all-to-all, all 64 tokens' rows arrive at two devices)."""
    model = tiny(0)
    w = model.weights()
    seg = w["segments"][1]
    seg["router_bias"] = seg["router_bias"].at[:, :2].set(10.0)
    cfg = model.config
    skewed = ErnieForCausalLM(cfg, w, dtype=jnp.float32)
    plan = ShardingPlan.create(make_mesh("data=1,expert=8,tensor=1"))
    sharded = dispatching(skewed.shard(plan), dispatch)
    x = jax.random.normal(jax.random.key(0), (4, 16, cfg.hidden_size))
    layer_w = jax.tree.map(lambda a: a[0], sharded.weights()["segments"][1])
    from ernie_jax.sharding.expert_parallel import moe_ep
    y, ids = jax.jit(lambda x, w: moe_ep(x, w, cfg, plan, sharded.execution))(x, layer_w)
    assert set(np.unique(np.asarray(ids))) == {0, 1}
    ref, _ = dense_moe_reference(x, jax.tree.map(lambda a: a[0], seg), cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=1e-5)
    # and end to end: every one of the 64 tokens through every MoE layer
    ids_tok = np.random.default_rng(2).integers(3, 256, (4, 16)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(sharded(ids_tok)), np.asarray(skewed(ids_tok)), atol=1e-5)


def traced_moe_layer(mesh: str, ex=REFERENCE):
    """The tiny config's bf16 MoE decoder layer under EP on `mesh` with the execution config `ex`, traced
    from abstract shapes (8 x 4 tokens) -> (traced, the layer's abstract weights)."""
    cfg = ErnieConfig.preset("tiny")
    plan = ShardingPlan.create(make_mesh(mesh))
    w = abstract_weights(cfg, jnp.bfloat16)["segments"][1]
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), w)
    layer = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), layer, plan.shardings(layer))
    x = jax.ShapeDtypeStruct((8, 4, cfg.hidden_size), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((8, 4), jnp.int32)
    return jax.jit(lambda h, w, p: decoder_layer(h, w, "moe", cfg, p, plan=plan, ex=ex)[0]).trace(x, layer, pos), layer


def test_ep_moe_has_no_expert_weight_all_gather_on_gpu_lowering():
    traced, layer = traced_moe_layer("data=1,expert=1,tensor=8")
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "all_gather" not in hlo and "all-gather" not in hlo
    assert "all_reduce" in hlo  # the psum that adds the experts' shares
    compiled = traced.lower().compile().as_text()
    E, H, F2 = layer["experts_up_gate"].shape
    for line in compiled.splitlines():
        if "all-gather" in line:
            assert f"[{E},{H},{F2}]" not in line and f"{E},{F2 // 2},{H}" not in line, line


def test_all_to_all_ep_lowers_to_ragged_all_to_all_on_gpu():
    """Lowered for CUDA with the dispatch a GPU selects, the all-to-all dispatch uses the real ragged
    all-to-all (twice: rows out, results back), and the only all-gathers are of routing counts and of the
    [T/n, H] outputs, never expert weights."""
    gpu = ExecutionConfig.select(Platform("gpu", (9, 0)), "xla")
    assert gpu.ep_dispatch == "all_to_all"
    traced, layer = traced_moe_layer("data=1,expert=8,tensor=1", gpu)
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("ragged_all_to_all") == 2
    E, H, F2 = layer["experts_up_gate"].shape
    gathers = [line for line in hlo.splitlines() if "all_gather" in line]
    assert gathers and not any(f"{E // 8}x{H}x{F2}" in g or f"{E}x{H}x{F2}" in g for g in gathers)


def test_per_device_bytes_and_direct_placement():
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, mesh="data=1,expert=8,tensor=1")
    per_device = model.device_bytes()
    assert len(per_device) == 8 and len(set(per_device.values())) == 1
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(load_pretrained(
        GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32).weights()))
    experts = sum(np.asarray(x).nbytes for s in model.weights()["segments"] for k, x in s.items() if "experts" in k)
    assert list(per_device.values())[0] == total - experts + experts // 8
    seg = model.weights()["segments"][1]["experts_up_gate"]
    assert {s.data.shape[1] for s in seg.addressable_shards} == {1}  # one expert per device, never a full copy


def test_k_major_block_fp8_specs_follow_the_logical_axes():
    """K-major values ([out, in], the kernels' layout) are split on the same logical dimension as the
    checkpoint's [in, out] values; the scales keep [in, out]; placing them gives each device its slice."""
    from ernie_jax.quant import quantize_block_fp8
    plan = ShardingPlan.create(make_mesh("data=1,expert=1,tensor=8"))
    w = quantize_block_fp8(np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32))
    kn, nk = plan.param_spec("qkv", w), plan.param_spec("qkv", w.relayout(True))
    assert tuple(kn.values) == (None, "tensor") and tuple(nk.values) == ("tensor", None)
    assert tuple(kn.scales) == tuple(nk.scales) == (None, "tensor")
    host = jax.tree.map(np.asarray, w.relayout(True))
    placed = jax.tree.map(lambda a, sh: jax.device_put(a, sh), host, plan.shardings({"qkv": host})["qkv"])
    assert {sh.data.shape for sh in placed.values.addressable_shards} == {(128, 256)}
    np.testing.assert_array_equal(np.asarray(placed.kn_values, np.float32), np.asarray(w.values, np.float32))


def test_bad_meshes_and_rules():
    with pytest.raises(MeshError, match="needs 16 devices but only 8"):
        make_mesh("data=2,expert=4,tensor=2")
    with pytest.raises(MeshError, match="multiply to 4, but there are 8 devices"):
        make_mesh("expert=2,tensor=2")
    with pytest.raises(MeshError, match="unknown axes"):
        make_mesh("pipeline=8")
    with pytest.raises(MeshError, match="needs 9 devices"):
        make_mesh(9)
    six = ErnieForCausalLM(ErnieConfig(**{**BASE, "moe_num_experts": 6}, moe_num_shared_experts=0),
                           rngs=nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(ShardingError, match="6 experts cannot be split evenly"):
        six.shard(ShardingPlan.create(make_mesh("data=1,expert=4,tensor=2")))
    with pytest.raises(ShardingError, match="same mesh axis"):
        ShardingPlan.create(make_mesh(8), {"vocab": "tensor", "embed": "tensor"})
    with pytest.raises(ShardingError, match="unknown sharding preset"):
        ShardingPlan.create(make_mesh(8), "fsdp")


def test_disjoint_submeshes():
    devs = jax.devices()
    a, b = make_mesh(4, devs[:4]), make_mesh(4, devs[4:])
    assert set(a.devices.flat).isdisjoint(set(b.devices.flat))
    ids = np.random.default_rng(3).integers(3, 256, (1, 6)).astype(np.int32)
    pa = tiny(1).shard(ShardingPlan.create(a))
    pb = tiny(1).shard(ShardingPlan.create(b))
    la, lb = pa.forward(ids), pb.forward(ids)
    assert la.logits.sharding.device_set <= set(devs[:4]) and lb.logits.sharding.device_set <= set(devs[4:])
    assert np.abs(np.asarray(la.logits) - np.asarray(lb.logits)).max() < 1e-5


def test_plan_cli_on_tiny(capsys):
    from ernie_jax.plan import main
    assert main(["--model", "tiny", "--mesh", "8", "--max-num-seqs", "4", "--max-model-len", "256",
                 "--prefill-devices", "4", "--decode-devices", "4", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert report["disaggregated"]
    for name in ("prefill", "decode"):
        r = report[name]
        assert r["devices"] == 4 and r["weights_bytes"] > 0 and r["kv_cache_bytes"] > 0 and r["temp_bytes"] >= 0
        assert r["fits"]["H200"] and r["compile_seconds"] > 0 and r["kv_tokens_fit"]["H100"] > 0
    cfg = ErnieConfig.preset("tiny")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    # the engine's pools where devices report no memory limit: 4 sequences x 16 pages + the null page, each
    assert report["decode"]["kv_pages"] == 65 and report["prefill"]["kv_pages"] == 65
    assert report["decode"]["kv_cache_bytes"] == 65 * 16 * per_token  # 2 KV heads do not split 4 ways: replicated
    assert report["decode"]["kv_tokens_fit"]["H200"] == int((0.9 * 141e9 - report["decode"]["weights_bytes"])
                                                            // per_token)


def test_one_device_mesh_is_the_unsharded_path():
    """A one-device mesh places the model unsharded on that device (no plan: the unsharded layouts and
    forms), with the same logits."""
    model = tiny(1)
    one = model.shard(ShardingPlan.create(make_mesh(1, jax.devices()[3:4])))
    assert one.plan is None
    assert {d.id for leaf in jax.tree.leaves(one.weights()) for d in leaf.devices()} == {3}
    ids = np.random.default_rng(5).integers(3, 256, (1, 6)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(one(ids)), np.asarray(model(ids)), atol=1e-6)


WIDE = dict(BASE, hidden_size=128, intermediate_size=256, num_attention_heads=16, num_key_value_heads=8)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def compiled_collectives(text: str) -> dict[str, int]:
    import re
    found = re.findall(r"= \S+ (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", text)
    return {c: found.count(c) for c in set(found)}


@pytest.mark.parametrize("mesh", ["data=1,expert=4,tensor=2", "data=1,expert=1,tensor=8"])
def test_fused_columns_need_no_collective_before_attention_or_activation(mesh):
    """Placed on a mesh, [Q|K|V] and [gate|up] hold one group per tensor shard (sharding/fused.py): a dense
    layer's compiled program has no collective but the two all-reduces of its row-parallel linears (o and
    down). In the checkpoint's layout XLA reshards q/k/v and gate/up (collective-permutes), which this
    test shows too, and both layouts compute the same logits."""
    cfg = ErnieConfig(**WIDE, moe_num_shared_experts=1)
    model = ErnieForCausalLM(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(3, 256, (2, 9)).astype(np.int32)
    counts, logits = {}, {}
    for fused in (True, False):
        plan = ShardingPlan.create(make_mesh(mesh), fused_layout=fused)
        sharded = model.shard(plan)
        w = jax.tree.map(lambda a: a[0], sharded.weights()["segments"][0])
        x = jax.device_put(jnp.ones((2, 4, 128), jnp.float32), plan.activation(("batch", None, "embed"), (2, 4, 128)))
        pos = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
        layer = jax.jit(lambda h, w, p: decoder_layer(h, w, "dense", cfg, p, plan=plan, ex=sharded.execution)[0])
        counts[fused] = compiled_collectives(layer.lower(x, w, pos).compile().as_text())
        logits[fused] = np.asarray(sharded(ids))
    assert counts[True] == {"all-reduce": 2}, counts
    assert counts[False].get("collective-permute", 0) + counts[False].get("all-gather", 0) > 0, counts
    np.testing.assert_allclose(logits[True], logits[False], atol=1e-5)
    np.testing.assert_allclose(logits[True], np.asarray(model(ids)), atol=1e-5)


def test_blocks_that_cannot_split_whole_are_replicated_over_the_tensor_devices(caplog):
    """fit_plan: the embedded model's attention (on 4 devices its 2 KV heads; on 2, its 64-column K and V, not
    whole FP8 scale blocks) is replicated over the tensor devices, its dense FFNs on 4 (192-column halves) but
    not on 2 (384), its experts and vocabulary still split; the tiny preset (bf16) keeps its split on 2 devices
    and replicates only attention on 4; 300B-FP8 on 8 devices and training's plan (no fused layout) are left as
    they are."""
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.sharding.fused import fit_plan
    attention = ("qkv", "heads", "q_heads", "kv_heads")
    plan = lambda n, **kw: ShardingPlan.create(make_mesh(n, jax.devices()[:n]), **kw)  # noqa: E731
    embedded = ErnieConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    w = abstract_weights(embedded, quantization="fp8")
    for n, why in ((4, "4 query and 2 KV heads do not both split 4 ways"),
                   (2, "groups of [128, 64, 64] columns are not whole 128-column FP8 scale blocks")):
        caplog.clear()
        with caplog.at_level("INFO", logger="ernie_jax.sharding"):
            fitted = fit_plan(plan(n), embedded, w)
        assert all(fitted.axes_of(a) == () for a in attention)
        assert fitted.axes_of("mlp") == (() if n == 4 else ("tensor",))
        assert fitted.axes_of("experts") == ("expert", "tensor") and fitted.axes_of("vocab") == ("tensor",)
        assert why in caplog.text and ("dense FFN replicated" in caplog.text) == (n == 4)
        seg = fitted.weight_specs(w)["segments"][1]
        assert seg["qkv"].values == P(None, None, None) and seg["experts_up_gate"].values[1] == ("expert", "tensor")
    tiny = ErnieConfig.preset("tiny")
    tw = abstract_weights(tiny)
    two = plan(2)
    assert fit_plan(two, tiny, tw) is two
    four = fit_plan(plan(4), tiny, tw)
    assert all(four.axes_of(a) == () for a in attention) and four.axes_of("mlp") == ("tensor",)
    big = ErnieConfig.preset("ernie-4.5-300b-a47b-fp8")
    eight = plan(8)
    assert fit_plan(eight, big, abstract_weights(big, quantization="fp8")) is eight
    training = plan(4, fused_layout=False)
    assert fit_plan(training, embedded, w) is training


def test_fused_layout_moves_whole_fp8_scale_blocks_and_back():
    """An FP8 model (head_dim 128, so each tensor shard's Q, K and V columns are whole 128-column scale blocks)
    re-laid for tensor=2, K-major or not: same logits as the checkpoint layout; checkpoint_weights() gives
    back the exact checkpoint tensors; a layout the groups cannot take (2 KV heads over 8) keeps the
    checkpoint's."""
    from ernie_jax.model.weights import quantize_weights
    from ernie_jax.quant import BlockFP8
    from ernie_jax.sharding.fused import fused_groups
    cfg = ErnieConfig(**dict(BASE, hidden_size=128, intermediate_size=256, head_dim=128), moe_num_shared_experts=1)
    host = quantize_weights(ErnieForCausalLM(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32).weights(), "weight_only")
    ids = np.random.default_rng(0).integers(3, 256, (2, 9)).astype(np.int32)
    ex = ExecutionConfig.select(Platform("cpu"))
    canonical = np.asarray(ErnieForCausalLM.from_host(cfg, host, jnp.float32, ShardingPlan.create(
        make_mesh("data=1,expert=4,tensor=2"), fused_layout=False), ex)(ids))
    for k_major in (False, True):
        tree = jax.tree.map(lambda w: w.relayout(k_major) if isinstance(w, BlockFP8) else w, host,
                            is_leaf=lambda x: isinstance(x, BlockFP8))
        plan = ShardingPlan.create(make_mesh("data=1,expert=4,tensor=2"))
        model = ErnieForCausalLM.from_host(cfg, tree, jnp.float32, plan, ex)
        seg = model.weights()["segments"][0]
        assert fused_groups(plan, cfg, "qkv", seg["qkv"]) == 2 and fused_groups(plan, cfg, "up_gate", seg["up_gate"]) == 2
        np.testing.assert_allclose(np.asarray(model(ids)), canonical, atol=1e-5)
        back = model.checkpoint_weights()
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    eight = ShardingPlan.create(make_mesh(8))
    assert fused_groups(eight, cfg, "qkv", host["segments"][0]["qkv"]) == 1


def test_plan_cli_compiles_the_speculative_programs(capsys):
    """With --speculative-config the plan compiles the MTP programs the engine serves: the decode step verifies
    k drafts (k + 1 tokens per sequence) and the pool holds the MTP block's KV (one layer more per token)."""
    from ernie_jax.plan import main
    common = ["--model", "tiny", "--mesh", "4", "--max-num-seqs", "4", "--max-model-len", "128", "--json"]
    reports = []
    for extra in ([], ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']):
        assert main(common + extra) == 0
        import json
        reports.append(json.loads(capsys.readouterr().out))
    plain, spec = reports
    L = ErnieConfig.preset("tiny").num_hidden_layers
    assert spec["speculative_tokens"] == 2 and spec["decode"]["tokens"] == 3
    assert spec["decode"]["kv_bytes_per_token"] == plain["decode"]["kv_bytes_per_token"] * (L + 1) / L
    assert spec["decode"]["flops"] > 2 * plain["decode"]["flops"] > 0


@pytest.mark.parametrize("dispatch", ["replicated", "all_to_all"])
@pytest.mark.parametrize("mesh", ["data=1,expert=8,tensor=1", "data=1,expert=4,tensor=2"])
def test_redundant_experts_leave_the_logits_unchanged(mesh, dispatch):
    """EPLB (sharding/eplb.py): 8 experts in 16 physical slots over the 8 EP devices, hot experts replicated
    from skewed loads; a token's assignment goes to one replica. Logits (full forward and decode through the
    cache) equal those without EPLB within 1e-6 (f32), with either dispatch, and checkpoint_weights() gives
    back the checkpoint's experts."""
    from ernie_jax.sharding import eplb
    ids = np.random.default_rng(3).integers(3, 256, (2, 9)).astype(np.int32)
    model = tiny(1)
    plan = ShardingPlan.create(make_mesh(mesh))
    ref_full, ref_dec = run(dispatching(model.shard(plan), dispatch), ids)
    load = np.random.default_rng(1).pareto(1.0, (model.config.num_moe_layers, 8)) * 100
    placement = eplb.plan(load, 8, 8)
    assert placement.replicas.max() > 2 and placement.slot_expert.shape == (2, 16)
    placed = ErnieForCausalLM.from_host(model.config, model.weights(), jnp.float32, plan, model.execution,
                                        expert_placement=placement)
    seg = placed.weights()["segments"][1]
    assert seg["experts_up_gate"].shape[1] == 16 and seg["expert_slots"].shape == (2, 8, 9)
    full, dec = run(dispatching(placed, dispatch), ids)
    assert np.abs(full - ref_full).max() < 1e-6 and np.abs(dec - ref_dec).max() < 1e-6
    for a, b in zip(jax.tree.leaves(placed.checkpoint_weights()), jax.tree.leaves(model.weights())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="needs expert parallelism"):
        ErnieForCausalLM.from_host(model.config, model.weights(), jnp.float32, None, model.execution,
                                   expert_placement=placement)
    with pytest.raises(ValueError, match="non-negative multiple of the expert-parallel size 8, got 4"):
        eplb.plan(load, 4, 8)
