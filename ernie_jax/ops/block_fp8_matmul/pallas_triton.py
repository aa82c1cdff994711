"""Block-FP8 matmul (FastDeploy w8a8 numerics) as a Pallas-Triton GPU kernel.

y[t, o] = sum over 128-wide K blocks kb of (x_q[t, kb] . w_q[kb, o]) * x_scale[t, kb] * w_scale[kb, o // 128]:
the activation tile is quantized to e4m3 per token per 128 channels inside the kernel, each K block is an
FP8 x FP8 product accumulated in f32, then promoted by the two scales (Hopper has no block-scaled MMA, so
the promotion is per K block, DeepGEMM style). Output in the activation dtype. Decode-sized M (16 rows or
fewer) splits the K blocks over several programs (split-K, `k_splits`) so that the few output tiles of a
decode step still fill the GPU; their f32 partial sums are added in XLA.

Backend: Pallas-Triton. Mosaic GPU is JAX's supported GPU backend, but an FP8 wgmma kernel there needs a
warp-specialised TMA pipeline and K-contiguous ([N, K]) weights, and its CPU interpreter is a private API;
the Triton lowering takes the same tiles through `tl.dot` on e4m3 operands (sm89+), runs in the generic
Pallas interpreter on CPU (the tests) and lowers for CUDA here.

Weight layout: Hopper's FP8 wgmma reads both operands K-major from shared memory, so with [K, N] weights
Triton must transpose every weight tile on its way to the MMA. The kernels therefore also take K-major
weights ([N, K], `k_major=True`; the tile is contracted on its second axis), and the model's loader stores
the FP8 linears that way when the kernels are in use (`ops.kernel_layout`); the checkpoint's [K, N]
stays accepted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ernie_jax.quant import FP8, FP8_MAX

BK = 128  # the K block of the weight scales and of the activation groups
BN = 128  # one weight-scale column per output tile


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _block_m(m: int) -> int:
    """Row tile: small for decode-sized M, 64 for prefill-sized."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def quantize_tile(x):
    """Per-row e4m3 quantization of a [rows, 128] f32 tile: (values, dequant scales [rows, 1])."""
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), 1e-10)
    return jnp.clip(x * (FP8_MAX / amax), -FP8_MAX, FP8_MAX).astype(FP8), amax / FP8_MAX


def weight_tile_dot(xq, w_ref, lead: tuple, kb, j, k_major: bool):
    """xq [bm, BK] e4m3 times weight tile (kb, j) -> [bm, BN] f32; the tile is [BN, BK] when k_major."""
    if k_major:
        w = w_ref[(*lead, pl.ds(j * BN, BN), pl.ds(kb * BK, BK))]
        return lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    w = w_ref[(*lead, pl.ds(kb * BK, BK), pl.ds(j * BN, BN))]
    return jnp.dot(xq, w, preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, ws_ref, o_ref, *, n_kb: int, bm: int, k_major: bool, kb_per_split: int):
    """One (row tile, column tile) over the K blocks of split program_id(2) (all of them when unsplit)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def body(kb, acc):
        xq, xs = quantize_tile(x_ref[pl.ds(i * bm, bm), pl.ds(kb * BK, BK)].astype(jnp.float32))
        return acc + weight_tile_dot(xq, w_ref, (), kb, j, k_major) * xs * ws_ref[kb, j]

    first = s * kb_per_split
    acc = lax.fori_loop(first, jnp.minimum(first + kb_per_split, n_kb), body, jnp.zeros((bm, BN), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def k_splits(tiles: int, n_kb: int, programs: int = 256, min_blocks: int = 4) -> int:
    """K splits for a matmul of `tiles` output tiles: decode-sized M leaves few tiles (one row tile times
    N/128), so the K blocks are shared out until there are about `programs` programs, each summing at least
    `min_blocks` K blocks; the f32 partial sums are added afterwards."""
    return max(1, min(n_kb // min_blocks, -(-programs // tiles)))


def pad_operands(x, w_q, w_scale, bm: int, k_major: bool):
    """Zero-pad rows to the row tile and K, N to whole 128 blocks (zeros add nothing to any product).
    Returns (x [Mp, Kp], w [..., Kp, Np] or [..., Np, Kp] when k_major, scales f32, Np)."""
    M, K = x.shape
    N = w_q.shape[-2] if k_major else w_q.shape[-1]
    Mp, Kp, Np = _round_up(M, bm), _round_up(K, BK), _round_up(N, BN)
    x = jnp.pad(x, ((0, Mp - M), (0, Kp - K)))
    pad_w = [(0, 0)] * (w_q.ndim - 2) + ([(0, Np - N), (0, Kp - K)] if k_major else [(0, Kp - K), (0, Np - N)])
    return x, jnp.pad(w_q, pad_w), w_scale.astype(jnp.float32), Np


@functools.partial(jax.jit, static_argnames=("k_major", "interpret"))
def block_fp8_matmul_pallas(x, w_q, w_scale, k_major: bool = False, interpret: bool = False):
    """x [M, K] (bf16/f32); w_q [K, N] e4m3 ([N, K] when k_major); w_scale [ceil(K/128), ceil(N/128)] f32
    -> [M, N] in x's dtype."""
    M, N = x.shape[0], w_q.shape[0 if k_major else 1]
    bm = _block_m(M)
    xp, wp, ws, Np = pad_operands(x, w_q, w_scale, bm, k_major)
    n_kb, tiles = xp.shape[1] // BK, (xp.shape[0] // bm) * (Np // BN)
    splits = k_splits(tiles, n_kb) if M <= 16 else 1
    kps = -(-n_kb // splits)
    out = pl.pallas_call(
        functools.partial(_kernel, n_kb=n_kb, bm=bm, k_major=k_major, kb_per_split=kps),
        out_shape=jax.ShapeDtypeStruct((splits, xp.shape[0], Np), jnp.float32 if splits > 1 else x.dtype),
        grid=(xp.shape[0] // bm, Np // BN, splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
        out_specs=pl.BlockSpec((None, bm, BN), lambda i, j, s: (s, i, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(xp, wp, ws)
    out = jnp.sum(out, axis=0).astype(x.dtype) if splits > 1 else out[0]
    return out[:M, :N]
