"""The op layer: kernels in interpret mode against their XLA references, their CUDA lowering (no GPU
needed), the XLA:CPU forms, the model's dispatch through the execution config, and the start-up self-check."""

import ast
import functools
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax.ops import ExecutionConfig, Platform
from ernie_jax.ops.block_fp8_matmul import block_fp8_matmul
from ernie_jax.ops.grouped_fp8_matmul import grouped_fp8_matmul
from ernie_jax.ops.paged_attention import paged_attention
from ernie_jax.quant import quantize_block_fp8
from tests.conftest import EMBEDDED_ENGINE

PALLAS = "pallas_triton"


def paged_decode(q, kp, vp, ks, vs, tables, lengths, implementation):
    """One query token per sequence (q [B,N,D]) whose cache holds `lengths` [B] tokens -> [B,N*D]."""
    out = paged_attention(q[:, None], kp, vp, ks, vs, tables, (lengths - 1)[:, None], implementation=implementation)
    return out[:, 0]


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)


@pytest.mark.parametrize("M, K, N", [(7, 200, 136), (1, 128, 128), (33, 384, 256), (70, 256, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_fp8_matmul(M, K, N, dtype):
    x = jax.random.normal(jax.random.key(M), (M, K)).astype(dtype)
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05)
    out = block_fp8_matmul(x, w.values, w.scales, implementation=PALLAS)
    ref = block_fp8_matmul(x, w.values, w.scales, implementation="xla")
    assert out.shape == (M, N) and out.dtype == dtype
    assert _rel(out, ref) < (1e-6 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("M, K, N", [(7, 200, 136), (2, 256, 1536), (16, 384, 256), (1, 128, 72)])
@pytest.mark.parametrize("values", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k_major", [False, True])
def test_xla_cpu_block_fp8_matmul_is_the_reference(M, K, N, values, k_major):
    """The XLA:CPU form (K blocks as one batched dot, the values as FP8, or as the bf16 / f32 the CPU layout
    holds them in) gives the reference's result: the same promotion and order of block sums, only a block's
    own additions may differ (a few f32 ulps); K padded to a block included."""
    x = jax.random.normal(jax.random.key(M), (M, K)).astype(jnp.bfloat16)
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05).relayout(k_major)
    out = block_fp8_matmul(x.astype(jnp.float32), w.values.astype(values), w.scales, k_major, implementation="xla_cpu")
    ref = block_fp8_matmul(x.astype(jnp.float32), w.values, w.scales, k_major, implementation="xla")
    assert out.shape == (M, N) and out.dtype == jnp.float32 and _rel(out, ref) < 1e-6
    under_vmap = jax.vmap(lambda v: block_fp8_matmul(x, v, w.scales, k_major, implementation="xla_cpu"))
    np.testing.assert_array_equal(np.asarray(under_vmap(jnp.stack([w.values.astype(values)] * 2))[1]),
                                  np.asarray(block_fp8_matmul(x, w.values.astype(values), w.scales, k_major,
                                                              implementation="xla_cpu")))


def test_xla_cpu_block_fp8_matmul_is_chosen_with_bf16_units_only(monkeypatch):
    """The execution config takes the XLA:CPU form, with the values held as bf16, on a CPU with native bf16
    dot products, and the reference with f32 values elsewhere, saying why."""
    from ernie_jax.ops.block_fp8_matmul import xla_cpu
    for dtype, impl in (("bfloat16", "xla_cpu"), ("float32", "xla")):
        monkeypatch.setattr(xla_cpu, "values_dtype", lambda dtype=dtype: dtype)
        ex = ExecutionConfig.select(Platform("cpu"))
        assert (ex.block_fp8_matmul, ex.cpu_fp8_values) == (impl, dtype)
    assert "no native bf16 dot products" in ex.describe()
    assert ExecutionConfig.select(Platform("gpu", (9, 0))).block_fp8_matmul == PALLAS


@pytest.mark.parametrize("M", [1, 16])
def test_decode_sized_matmul_splits_k(M):
    """Decode-sized M shares the K blocks out over several programs (split-K) and adds their f32 partial
    sums: the reference's result, for [K, N] and K-major weights."""
    from ernie_jax.ops.block_fp8_matmul.pallas_triton import k_splits
    K, N = 2048, 256
    assert k_splits(tiles=N // 128, n_kb=K // 128) == 4
    x = jax.random.normal(jax.random.key(M), (M, K))
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05)
    ref = block_fp8_matmul(x, w.values, w.scales, implementation="xla")
    t = w.relayout(True)
    assert _rel(block_fp8_matmul(x, w.values, w.scales, implementation=PALLAS), ref) < 1e-5
    assert _rel(block_fp8_matmul(x, t.values, t.scales, True, implementation=PALLAS), ref) < 1e-5


@pytest.mark.parametrize("M, K, N", [(7, 200, 136), (33, 384, 256), (5, 256, 256)])
@pytest.mark.parametrize("impl", [PALLAS, "xla"])
def test_block_fp8_matmul_k_major(M, K, N, impl):
    """K-major weights ([N, K], as the loader stores them for the kernels) give the [K, N] reference's
    result, square shapes included (where only the flag tells the layouts apart)."""
    x = jax.random.normal(jax.random.key(M), (M, K))
    w = quantize_block_fp8(jax.random.normal(jax.random.key(K), (K, N)) * 0.05)
    t = w.relayout(True)
    assert t.values.shape == (N, K) and t.shape == (K, N)
    out = block_fp8_matmul(x, t.values, t.scales, True, implementation=impl)
    ref = block_fp8_matmul(x, w.values, w.scales, implementation="xla")
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
    out = grouped_fp8_matmul(x, t.values, t.scales, gs, k_major, implementation=PALLAS)
    ref = grouped_fp8_matmul(x, w.values, w.scales, gs, implementation="xla")
    assert _rel(out, ref) < 1e-6
    assert not np.asarray(out[sum(sizes):]).any()


def test_grouped_kernel_computes_only_the_tiles_groups_fill():
    """The buffer's tiles past the groups' rows are never computed: they are NaN here, which any product
    they entered would spread, and they come back as zeros while the real tiles match the reference."""
    from ernie_jax.ops.grouped_fp8_matmul.pallas_triton import grouped_tiles, pad_operands, row_tile, tile_layout
    sizes, K, N, M = [5, 0, 20], 256, 128, 64  # a static buffer far larger than the 25 routed rows
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = quantize_block_fp8(jax.random.normal(jax.random.key(1), (3, K, N)) * 0.05)
    gs = jnp.asarray(sizes, jnp.int32)
    bm = row_tile(M, 3)
    dest, valid, tile_group, Mp, used = tile_layout(gs, M, bm)
    assert int(used[0]) == 2 * bm < Mp  # group 0 and group 2 fill one tile each
    past = (jnp.arange(Mp) >= used[0])[:, None]  # the tiles no group reaches: NaN, with the rows past the groups
    xp = jnp.where(past, jnp.full((Mp, K), jnp.nan), 0.0).at[dest].set(jnp.where(valid[:, None], x, jnp.nan))
    xp, wp, ws, _ = pad_operands(xp, w.values, w.scales, bm, False)
    out = np.asarray(grouped_tiles(tile_group, used, xp, wp, ws, bm=bm, k_major=False, interpret=True))
    assert not out[int(used[0]):].any() and np.isfinite(out).all()
    ref = grouped_fp8_matmul(x, w.values, w.scales, gs, implementation="xla")
    assert _rel(out[np.asarray(dest)[:25]], ref[:25]) < 1e-6


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
    out = paged_decode(q, kp, vp, ks, vs, tables, lengths, PALLAS)
    for impl in ("xla", "xla_cpu"):
        assert _rel(out, paged_decode(q, kp, vp, ks, vs, tables, lengths, impl)) < 1e-5


def test_split_kv_decode_attention():
    """Decode splits each sequence's pages over several programs (flash-decoding) and merges their partial
    softmaxes: with sequences of very different lengths (some splits past a sequence's end hold nothing)
    and a padding row, the unsplit reference's result."""
    from ernie_jax.ops.paged_attention.pallas_triton import kv_splits
    B, N, K, D, P, page, n = 2, 8, 2, 64, 20, 16, 8
    assert kv_splits(B, K, n) == n  # a split per page here
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((B + 1, N, D)), jnp.float32)
    kp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.float32)
    tables = jnp.asarray([[3, 7, 1, 9, 11, 13, 15, 17], [5, 2, 0, 0, 0, 0, 0, 0], [4, 6, 8, 10, 0, 0, 0, 0]],
                         jnp.int32)
    lengths = jnp.asarray([61, 3, 0], jnp.int32)  # the last row is padding (position -1)
    out = paged_decode(q, kp, vp, None, None, tables, lengths, PALLAS)
    ref = paged_decode(q, kp, vp, None, None, tables, lengths, "xla")
    assert _rel(out[:2], ref[:2]) < 1e-5 and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("impl", [PALLAS, "xla_cpu", "xla"])
def test_padding_positions_attend_to_nothing_and_give_zero(impl):
    """A padding position (-1) sees no key: every implementation returns 0 there, so the kernel's start-up
    self-check case (a padding row in its batch; it failed on an H200 comparing two arbitrary averages of
    masked slots, max relative error 0.302) compares defined rows, and passes in the interpreter."""
    from ernie_jax.ops import selfcheck
    args = selfcheck._attention_case(np.random.default_rng(0))
    out = np.asarray(paged_attention(*args, implementation=impl, platform=Platform("cpu")), np.float32)
    ref = np.asarray(paged_attention(*args, implementation="xla"), np.float32)
    positions = np.asarray(args[-1])
    assert not out[positions < 0].any() and out[positions >= 0].all(axis=-1).any()
    assert _rel(out, ref) <= selfcheck.TOLERANCE


def test_small_pages_take_the_xla_attention_and_say_so():
    """The kernel's score and value products are page-wide: pages under 16 slots (below the MMA tile) take the
    next implementation for the platform, noted once, with its result (which matches the reference's)."""
    from ernie_jax.ops import base
    from ernie_jax.ops.paged_attention import OP
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 64)), jnp.float32)
    kp, vp = (jnp.asarray(rng.standard_normal((9, 8, 2, 64)), jnp.float32) for _ in range(2))
    tables = jnp.asarray([[1, 3, 5, 7], [2, 4, 6, 8]], jnp.int32)
    positions = jnp.asarray([[20], [9]], jnp.int32)
    run = functools.partial(paged_attention, q, kp, vp, None, None, tables, positions, platform=Platform("cpu"))
    out = run(implementation=PALLAS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run(implementation=OP.choose(Platform("cpu"),
                                                                                           after=PALLAS)[0])))
    assert _rel(out, run(implementation="xla")) < 1e-5  # the next one on CPU is xla_cpu: its sums run in another order
    assert ("paged_attention", PALLAS, "pages of 8 key slots (the kernel's score and value products need 16 or "
            "more)") in base.FALLBACKS


@pytest.mark.parametrize("impl", ["xla", "xla_cpu"])
@pytest.mark.parametrize("T", [3, 1], ids=["chunk", "decode"])
@pytest.mark.parametrize("block_slots", [16, 64])
def test_xla_paged_attention_reads_only_what_positions_reach(block_slots, T, impl):
    """The XLA forms (the reference, and XLA:CPU's, which for decode reads the slots of every KV head in one
    block-diagonal matmul) equal dense attention over the gathered slots, for prefill chunks and decode, and
    never touch pages past the block holding the batch's largest position: they are NaN here, and would
    poison any product they entered."""
    from ernie_jax.model import layers
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
    out = paged_attention(q, jnp.asarray(kp), jnp.asarray(vp), None, None, jnp.asarray(tables),
                          jnp.asarray(positions), implementation=impl, block_slots=block_slots)
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
    out = paged_attention(q, kp, vp, ks, vs, tables, positions, implementation=PALLAS)
    ref = paged_attention(q, kp, vp, ks, vs, tables, positions, implementation="xla")
    assert _rel(out[0], ref[0]) < 1e-5 and _rel(out[1, :-1], ref[1, :-1]) < 1e-5


def test_every_kernel_lowers_for_cuda():
    from ernie_jax.ops.block_fp8_matmul.pallas_triton import block_fp8_matmul_pallas
    from ernie_jax.ops.grouped_fp8_matmul.pallas_triton import grouped_block_fp8_matmul_pallas
    from ernie_jax.ops.paged_attention.pallas_triton import paged_attention_pallas
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
    from ernie_jax.ops.grouped_int_matmul.pallas_triton import grouped_int_matmul_pallas
    from ernie_jax.ops.int_weight_matmul.pallas_triton import int_weight_matmul_pallas
    i8 = jnp.int8
    integer = [  # wint8, grouped wint4 at decode size, W4A8 (dense and the 300B-shaped experts), grouped wint4 experts
        (functools.partial(int_weight_matmul_pallas, bits=8, group=-1, rows=8192),
         (sds((64, 8192), bf), sds((8192, 10240), i8), sds((1, 10240), f32))),
        (functools.partial(int_weight_matmul_pallas, bits=4, group=128, rows=8192),
         (sds((1, 8192), bf), sds((4096, 10240), i8), sds((64, 10240), f32))),
        (functools.partial(int_weight_matmul_pallas, bits=4, group=-1, rows=8192, w4a8=True),
         (sds((16, 8192), bf), sds((4096, 10240), i8), sds((1, 10240), f32))),
        (functools.partial(grouped_int_matmul_pallas, bits=4, group=-1, rows=8192, w4a8=True),
         (sds((256, 8192), bf), sds((8, 4096, 7168), i8), sds((8, 1, 7168), f32), sds((8,), i32))),
        (functools.partial(grouped_int_matmul_pallas, bits=4, group=64, rows=3584),
         (sds((256, 3584), bf), sds((8, 1792, 8192), i8), sds((8, 56, 8192), f32), sds((8,), i32))),
    ]
    for fn, args in cases + k_major + integer:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text.lower() or "pallas" in text.lower() or "custom_call" in text


KERNEL_MODULES = {"block_fp8_matmul_pallas": "ernie_jax.ops.block_fp8_matmul",
                  "grouped_block_fp8_matmul_pallas": "ernie_jax.ops.grouped_fp8_matmul",
                  "paged_attention_pallas": "ernie_jax.ops.paged_attention",
                  "int_weight_matmul_pallas": "ernie_jax.ops.int_weight_matmul",
                  "grouped_int_matmul_pallas": "ernie_jax.ops.grouped_int_matmul"}


def record_kernels(monkeypatch) -> set:
    """The names of the kernels traced from now on (each op's dispatch calls them through its module)."""
    import importlib
    used = set()
    for name, module in KERNEL_MODULES.items():
        mod = importlib.import_module(module)
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: used.add(_name) or _real(*a, **k))
    return used


def with_kernels(model):
    """`model` placed again with the kernels forced (interpreted here) and the grouped expert matmul, as a
    GPU runs it: every w8a8 block-FP8 matrix K-major."""
    from ernie_jax.model.ernie import ErnieForCausalLM
    from ernie_jax.quant import BlockFP8
    ex = ExecutionConfig.select(Platform("cpu"), "pallas", routed_experts="ragged")
    assert ex.uses_kernel("block_fp8_matmul") and ex.uses_kernel("paged_attention") and not ex.kv_bf16_bits
    placed = ErnieForCausalLM.from_host(model.config, model.checkpoint_weights(), model.dtype, model.plan, ex)
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
    ids = g["input_ids"][:1, :5]  # a 4-token prefill, then one decode step (kernels run interpreted: slow)

    def decode(m):
        cache = m.init_cache(1, 16)
        out = m.forward(ids[:, :4], np.arange(4)[None], cache)
        logits = [np.asarray(out.logits)]
        for t in range(4, 5):
            out = m.forward(ids[:, t:t + 1], np.full((1, 1), t), out.cache)
            logits.append(np.asarray(out.logits))
        return np.concatenate(logits, axis=1)
    ref = decode(model)
    used = record_kernels(monkeypatch)
    out = decode(with_kernels(model))
    assert used == {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas", "paged_attention_pallas"}
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("mesh, kernels_used", [
    ("data=1,expert=8,tensor=1", {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas",
                                  "paged_attention_pallas"}),  # linears unsplit: whole on each device
    ("data=1,expert=4,tensor=2", {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas",
                                  "paged_attention_pallas"}),
    # pages split by data: XLA attention
    ("data=2,expert=2,tensor=2", {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas"}),
])
def test_sharded_programs_use_kernels_where_shards_allow(monkeypatch, golden, mesh, kernels_used):
    """Under a mesh the expert matmul inside the expert-parallel shard_map and attention per device over its
    KV heads take the kernels; this model's linears (hidden 64) do not split over a tensor axis into whole
    128-blocks per device, so the plan keeps them whole on each device (sharding/fused.fit_plan) and the
    linear kernel runs there on the whole weight."""
    from ernie_jax import load_pretrained
    from tests.conftest import GOLDEN
    g = golden("shared_untied")
    model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8", mesh=mesh)
    ids = g["input_ids"][:, :5]

    def decode(m):
        out = m.forward(ids[:, :4], np.broadcast_to(np.arange(4), (2, 4)), m.init_cache(2, 16))
        out = m.forward(ids[:, 4:5], np.full((2, 1), 4), out.cache)
        return np.asarray(out.logits)
    ref = decode(model)
    used = record_kernels(monkeypatch)
    out = decode(with_kernels(model))
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
    ref = logits(model)
    used = record_kernels(monkeypatch)
    out = logits(with_kernels(model))
    assert used == {"block_fp8_matmul_pallas", "grouped_block_fp8_matmul_pallas", "paged_attention_pallas"}
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max()


def test_execution_config_choice_per_platform():
    """Each op takes its first supported implementation and says why it passed over the others: an A100 (8.0)
    has no FP8 MMA, so it keeps the FP8 matmuls on XLA and runs the attention kernel."""
    from ernie_jax.ops import cpu_kernels
    from ernie_jax.ops.block_fp8_matmul.xla_cpu import supports
    cpu = ExecutionConfig.select(Platform("cpu"))
    fp8 = "xla_cpu" if supports(Platform("cpu")) is None else "xla"  # where the CPU has bf16 dot products
    built = cpu_kernels.unavailable("matvec") is None and cpu_kernels.unavailable("paged_attention") is None
    want = ("cpu_decode", "cpu_matvec", "cpu_matvec") if built else ("xla_cpu", "xla_cpu", "xla")  # a C++ compiler
    assert (cpu.block_fp8_matmul, cpu.paged_attention, cpu.routed_experts, cpu.dense_matmul, cpu.ep_dispatch) == \
        (fp8, *want, "replicated") and cpu.kv_bf16_bits
    a100 = ExecutionConfig.select(Platform("gpu", (8, 0)))
    assert (a100.block_fp8_matmul, a100.grouped_fp8_matmul, a100.paged_attention, a100.routed_experts) == \
        ("xla", "xla", PALLAS, "ragged")
    assert any(op == "block_fp8_matmul" and "8.9" in why for op, _, why in a100.passed_over)
    h200 = ExecutionConfig.select(Platform("gpu", (9, 0)))
    assert h200.block_fp8_matmul == PALLAS and h200.ep_dispatch == "all_to_all" and h200.kernel_layout
    off = ExecutionConfig.select(Platform("gpu", (9, 0)), "xla")
    assert not any(off.uses_kernel(op) for op in ("block_fp8_matmul", "grouped_fp8_matmul", "paged_attention"))
    assert len({cpu, a100, h200, off}) == 4 and hash(h200) == hash(ExecutionConfig.select(Platform("gpu", (9, 0))))
    with pytest.raises(ValueError, match="routed_experts.*unknown implementation 'fast'"):
        ExecutionConfig(routed_experts="fast")


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_layers_import_one_way():
    """ops imports nothing above it; sharding imports ops but not the model; the model imports both:
    no circle among ops, sharding and model (every import, lazy ones included)."""
    root = pathlib.Path(__file__).parents[1] / "ernie_jax"
    above = {"ops": ("ernie_jax.model", "ernie_jax.sharding", "ernie_jax.engine", "ernie_jax.serve"),
             "sharding": ("ernie_jax.model", "ernie_jax.engine", "ernie_jax.serve"),
             "model": ("ernie_jax.engine", "ernie_jax.serve")}
    for package, banned in above.items():
        for path in (root / package).rglob("*.py"):
            bad = [m for m in _imports(path) if m.startswith(banned)]
            assert not bad, f"{path.relative_to(root)} imports {bad}"


def test_a_failing_kernel_falls_back_at_start_up(monkeypatch, caplog):
    """A kernel that fails its self-check on this device (here: an injected one that raises) is replaced by
    its op's next implementation: the engine starts, logs the fallback, serves, and its compile report and
    metrics name it."""
    from ernie_jax import LLM, SamplingParams
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    from ernie_jax.ops import base, block_fp8_matmul as op_module

    def broken(*args, **kwargs):
        raise RuntimeError("no FP8 MMA on this device")
    injected = base.Implementation("broken_kernel", broken, lambda platform: None, kernel=True)
    monkeypatch.setattr(op_module.OP, "implementations", (injected,) + op_module.OP.implementations)
    with caplog.at_level(logging.WARNING, logger="ernie_jax.ops"):
        # the shared engine shape: once the kernel falls back, the programs are the same ones
        llm = LLM(EMBEDDED_MODEL_DIR, **EMBEDDED_ENGINE)
    assert any("broken_kernel" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
    ops = {o["op"]: o for o in llm.engine.compile_report.ops}
    assert ops["block_fp8_matmul"]["implementation"] == ExecutionConfig.select(Platform("cpu"), "xla").block_fp8_matmul
    assert "broken_kernel: self-check failed: RuntimeError: no FP8 MMA" in ops["block_fp8_matmul"]["passed_over"]
    out = llm.generate(prompt_token_ids=[[1, 300, 42]], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    from ernie_jax.serve.metrics import ServerMetrics
    text = ServerMetrics(llm.engine.stats, "m").render().decode()
    assert 'ernie_jax:op_implementation_info{' in text and 'broken_kernel: self-check failed' in text
