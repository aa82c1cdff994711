"""Pallas kernels in interpret mode against their XLA references, and their CUDA lowering (no GPU needed)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import pallas as kernels
from ernie_jax.quant import quantize_block_fp8


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)


@pytest.mark.parametrize("M, K, N", [(7, 200, 136), (1, 128, 128), (33, 384, 256), (70, 256, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_fp8_matmul(M, K, N, dtype):
    x = jax.random.normal(jax.random.key(M), (M, K)).astype(dtype)
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05)
    out = kernels.block_fp8_matmul(x, w.values, w.scales, implementation="pallas")
    ref = kernels.block_fp8_matmul(x, w.values, w.scales, implementation="xla")
    assert out.shape == (M, N) and out.dtype == dtype
    assert _rel(out, ref) < (1e-6 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("M, K, N", [(7, 200, 136), (33, 384, 256), (5, 256, 256)])
@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_block_fp8_matmul_k_major(M, K, N, impl):
    """K-major weights ([N, K], as the loader stores them for the kernels) give the [K, N] reference's
    result, square shapes included (where only the flag tells the layouts apart)."""
    x = jax.random.normal(jax.random.key(M), (M, K))
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05)
    t = w.relayout(True)
    assert t.values.shape == (N, K) and t.shape == (K, N)
    out = kernels.block_fp8_matmul(x, t.values, t.scales, implementation=impl, k_major=True)
    ref = kernels.block_fp8_matmul(x, w.values, w.scales, implementation="xla")
    assert _rel(out, ref) < 1e-6


@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("sizes", [[3, 0, 5, 1], [0, 0, 9, 0], [40, 2, 0, 30]])
def test_grouped_block_fp8_matmul(sizes, k_major):
    G, K, N = len(sizes), 200, 136
    M = sum(sizes) + 2  # two rows past the groups must come back as zeros
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = quantize_block_fp8(jax.random.normal(jax.random.key(1), (G, K, N)) * 0.05)
    t = w.relayout(k_major)
    gs = jnp.asarray(sizes, jnp.int32)
    out = kernels.grouped_block_fp8_matmul(x, t.values, t.scales, gs, implementation="pallas", k_major=k_major)
    ref = kernels.grouped_block_fp8_matmul(x, w.values, w.scales, gs, implementation="xla")
    assert _rel(out, ref) < 1e-6
    assert not np.asarray(out[sum(sizes):]).any()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("N, K", [(8, 2), (10, 2)])  # 4 and 5 query heads per KV head
def test_paged_decode_attention(fp8, N, K):
    B, D, P, page = 3, 64, 12, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, N, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    ks = vs = None
    if fp8:
        ks = jnp.asarray(rng.uniform(0.01, 0.02, (P, page, K)), jnp.float32)
        vs = jnp.asarray(rng.uniform(0.01, 0.02, (P, page, K)), jnp.float32)
        kp, vp = (kp * 20).astype(jnp.float8_e4m3fn), (vp * 20).astype(jnp.float8_e4m3fn)
    tables = jnp.asarray([[3, 7, 1, 0], [5, 2, 0, 0], [11, 9, 8, 4]], jnp.int32)  # non-contiguous, unused tails
    lengths = jnp.asarray([37, 5, 64], jnp.int32)  # not multiples of the page size
    out = kernels.paged_decode_attention(q, kp, vp, ks, vs, tables, lengths, implementation="pallas")
    ref = kernels.paged_decode_attention(q, kp, vp, ks, vs, tables, lengths, implementation="xla")
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("T", [3, 1], ids=["chunk", "decode"])
@pytest.mark.parametrize("block_slots", [16, 64])
def test_xla_paged_attention_reads_only_what_positions_reach(monkeypatch, block_slots, T):
    """The XLA path (layers.paged_attention_blocks, the kernels' reference) equals dense attention over the
    gathered slots, for prefill chunks and for decode (T = 1, which reads the slots of every KV head in one
    matmul), and never touches pages past the block holding the batch's largest position: they are NaN
    here, and would poison any product they entered."""
    from ernie_jax.model import layers
    monkeypatch.setattr(layers, "PAGED_BLOCK_SLOTS", block_slots)
    B, N, K, D, page = 2, 4, 2, 16, 8
    rng = np.random.default_rng(1)
    kp = rng.standard_normal((10, page, K, D)).astype(np.float32)
    vp = rng.standard_normal((10, page, K, D)).astype(np.float32)
    tables = np.array([[4, 1, 7, 9, 0, 0, 0, 0], [2, 5, 3, 8, 0, 0, 0, 0]], np.int32)
    # a padding token; sequences of 23 and 11
    positions = np.array([[20, 21, 22], [-1, 9, 10]], np.int32)[:, 3 - T:]
    q = jnp.asarray(rng.standard_normal((B, 3, N, D)), jnp.float32)[:, 3 - T:]
    slots = np.broadcast_to(np.arange(32), (B, 32))
    dense = layers.attention(q, jnp.asarray(kp[tables[:, :4]].reshape(B, 32, K, D)),
                             jnp.asarray(vp[tables[:, :4]].reshape(B, 32, K, D)), jnp.asarray(positions), slots)
    reach = -(-23 // block_slots) * block_slots // page  # pages of the blocks the largest position needs
    for p in set(tables[:, reach:].ravel()) - set(tables[:, :reach].ravel()):
        kp[p] = vp[p] = np.nan
    out = layers.paged_attention_blocks(q, jnp.asarray(kp), jnp.asarray(vp), None, None, jnp.asarray(tables),
                                        jnp.asarray(positions))
    assert np.isfinite(np.asarray(out)).all()
    real = positions >= 0
    assert _rel(np.asarray(out)[real], np.asarray(dense)[real]) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T, start", [(5, 0), (16, 7), (3, 40)])
def test_paged_prefill_attention(fp8, T, start):
    """Causal attention of a chunk of T tokens at positions start.. over its pages (earlier chunks included)."""
    B, N, K, D, P, page = 2, 10, 2, 64, 12, 16
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    ks = vs = None
    if fp8:
        ks = vs = jnp.asarray(rng.uniform(0.01, 0.02, (P, page, K)), jnp.float32)
        kp, vp = (kp * 20).astype(jnp.float8_e4m3fn), (vp * 20).astype(jnp.float8_e4m3fn)
    tables = jnp.asarray([[3, 7, 1, 0], [5, 2, 9, 11]], jnp.int32)
    positions = jnp.asarray(start + np.arange(T)[None].repeat(B, 0), jnp.int32).at[1, -1].set(-1)  # a padding token
    out = kernels.paged_attention(q, kp, vp, ks, vs, tables, positions, implementation="pallas")
    ref = kernels.paged_attention(q, kp, vp, ks, vs, tables, positions, implementation="xla")
    assert _rel(out[0], ref[0]) < 1e-5 and _rel(out[1, :-1], ref[1, :-1]) < 1e-5


def test_every_kernel_lowers_for_cuda():
    from ernie_jax.pallas.block_fp8_matmul import block_fp8_matmul_pallas
    from ernie_jax.pallas.grouped_fp8_matmul import grouped_block_fp8_matmul_pallas
    from ernie_jax.pallas.paged_attention import paged_attention_pallas
    sds = jax.ShapeDtypeStruct
    f8, bf, f32, i32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32
    cases = [
        (block_fp8_matmul_pallas, (sds((64, 8192), bf), sds((8192, 10240), f8), sds((64, 80), f32))),
        (grouped_block_fp8_matmul_pallas, (sds((256, 8192), bf), sds((8, 8192, 7168), f8), sds((8, 64, 56), f32),
                                           sds((8,), i32))),
        (paged_attention_pallas, (sds((32, 1, 64, 128), bf), sds((512, 16, 8, 128), f8), sds((512, 16, 8, 128), f8),
                                  sds((512, 16, 8), f32), sds((512, 16, 8), f32), sds((32, 64), i32), sds((32, 1), i32))),
        (paged_attention_pallas, (sds((1, 512, 64, 128), bf), sds((512, 16, 8, 128), f8), sds((512, 16, 8, 128), f8),
                                  sds((512, 16, 8), f32), sds((512, 16, 8), f32), sds((1, 64), i32), sds((1, 512), i32))),
    ]
    k_major = [  # the layout the loader gives the kernels: [N, K] weights
        (functools.partial(block_fp8_matmul_pallas, k_major=True),
         (sds((64, 8192), bf), sds((10240, 8192), f8), sds((64, 80), f32))),
        (functools.partial(grouped_block_fp8_matmul_pallas, k_major=True),
         (sds((256, 3584), bf), sds((8, 8192, 3584), f8), sds((8, 28, 64), f32), sds((8,), i32))),
    ]
    for fn, args in cases + k_major:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower() or "pallas" in text.lower() or "custom_call" in text


def run_with_kernels(monkeypatch, fn, *args):
    """fn(*args) with the model's dispatch forced onto the (interpreted) kernels, as on a GPU; returns
    (result, names of the kernels that were traced)."""
    from ernie_jax.model import layers
    used = set()
    for name in ("block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas", "paged_attention_pallas"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **k: used.add(_name) or _real(*a, **k))
    monkeypatch.setattr(kernels, "use_kernels", lambda: True)
    monkeypatch.setattr(kernels, "resolve", lambda impl: impl or "pallas")
    monkeypatch.setattr(layers, "EXPERT_IMPL", "ragged")
    jax.clear_caches()
    try:
        return fn(*args), used
    finally:
        jax.clear_caches()


def loaded_for_kernels(model):
    """`model` placed again as the loader places it when the kernels are in use (call under
    run_with_kernels): every w8a8 block-FP8 matrix K-major."""
    from ernie_jax.model.ernie import ErnieForCausalLM
    from ernie_jax.quant import BlockFP8
    placed = ErnieForCausalLM.from_host(model.config, model.weights(), model.dtype, model.plan)
    fp8 = [w for w in jax.tree.leaves(placed.weights(), is_leaf=lambda x: isinstance(x, BlockFP8))
           if isinstance(w, BlockFP8)]
    assert fp8 and all(w.k_major for w in fp8)
    return placed


def test_model_runs_through_the_kernels(monkeypatch, golden):
    """The model's dispatch: the FP8 linears, the grouped expert matmul and decode attention all go through
    the kernels (interpreted here) and agree with the XLA paths."""
    from ernie_jax import load_pretrained
    from tests.conftest import GOLDEN
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8")
    ids = g["input_ids"][:1, :6]

    def decode(m):
        cache = m.init_cache(1, 16)
        out = m.forward(ids[:, :4], np.arange(4)[None], cache)
        logits = [np.asarray(out.logits)]
        for t in range(4, 6):
            out = m.forward(ids[:, t:t + 1], np.full((1, 1), t), out.cache)
            logits.append(np.asarray(out.logits))
        return np.concatenate(logits, axis=1)
    jax.clear_caches()
    ref = decode(model)
    out, used = run_with_kernels(monkeypatch, lambda m: decode(loaded_for_kernels(m)), model)
    assert used == {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas", "paged_attention_pallas"}
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("mesh, kernels_used", [
    ("data=1,expert=8,tensor=1", {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas",
                                  "paged_attention_pallas"}),  # linears unsplit: whole on each device
    ("data=1,expert=4,tensor=2", {"grouped_block_fp8_matmul_pallas", "paged_attention_pallas"}),
    ("data=2,expert=2,tensor=2", {"grouped_block_fp8_matmul_pallas"}),  # pages split by data: XLA attention
])
def test_sharded_programs_use_kernels_where_shards_allow(monkeypatch, golden, mesh, kernels_used):
    """Under a mesh the expert matmul inside the expert-parallel shard_map and attention per device over its
    KV heads take the kernels; this model's linears (hidden 64) do not split over a tensor axis into whole
    128-blocks per device, so there they keep the XLA path."""
    from ernie_jax import load_pretrained
    from tests.conftest import GOLDEN
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8", mesh=mesh)
    ids = g["input_ids"][:, :5]

    def decode(m):
        out = m.forward(ids[:, :4], np.broadcast_to(np.arange(4), (2, 4)), m.init_cache(2, 16))
        out = m.forward(ids[:, 4:5], np.full((2, 1), 4), out.cache)
        return np.asarray(out.logits)
    jax.clear_caches()
    ref = decode(model)
    out, used = run_with_kernels(monkeypatch, lambda m: decode(loaded_for_kernels(m)), model)
    assert used == kernels_used
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()


def test_sharded_fp8_linears_run_the_kernel_per_device(monkeypatch):
    """The embedded FP8 model (hidden 256) on tensor=2: qkv and up_gate split by output columns, o and down
    by input rows, each into whole 128-blocks, so every linear runs the block-FP8 kernel on its shard
    (row-parallel ones add the partial products with a psum) and matches the XLA partitioned path."""
    from ernie_jax import load_pretrained
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    model = load_pretrained(EMBEDDED_MODEL_DIR, dtype=jnp.float32, mesh="data=1,expert=4,tensor=2")
    ids = np.array([[5, 17, 300, 42, 7]], np.int32)

    def logits(m):
        return np.asarray(m.forward(ids, np.arange(5)[None], m.init_cache(1, 16)).logits)
    jax.clear_caches()
    ref = logits(model)
    out, used = run_with_kernels(monkeypatch, lambda m: logits(loaded_for_kernels(m)), model)
    assert used == {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas", "paged_attention_pallas"}
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()
