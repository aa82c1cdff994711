"""Grouped block-FP8 matmul for MoE experts (rows sorted by expert, ragged groups) as a Pallas-Triton GPU kernel.

x [M, K] rows sorted by group, group_sizes [G]: rows of group g use w_q[g] [K, N] with w_scale[g]. The
wrapper lays the rows out so that every group starts on a row-tile boundary (at most bm - 1 padding rows
per group, a static bound), records each tile's group, and the kernel (the block_fp8_matmul kernel body
with the tile's group picked from that table) never mixes two experts in one MMA tile. Empty groups get no
tile. Rows past sum(group_sizes) produce zeros, as in `lax.ragged_dot`.

The buffer's size is static (the worst case: under the expert-parallel all-to-all it is the largest receive
a device could get, about 8x the routed rows at 300B/EP8), so the kernel reads the number of tiles the
groups really fill and computes only those: a tile past them stores zeros without loading a row or a
weight, and a device's cost follows its routed rows, not the buffer. Backend: Pallas-Triton, for the
reasons in block_fp8_matmul/pallas_triton.py; like that kernel it takes [K, N] or K-major [N, K] weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ernie_jax.ops.block_fp8_matmul.pallas_triton import BK, BN, _round_up, pad_operands, quantize_tile, weight_tile_dot


def _kernel(tile_group_ref, used_ref, x_ref, w_ref, ws_ref, o_ref, *, n_kb: int, bm: int, k_major: bool):
    i, j = pl.program_id(0), pl.program_id(1)
    live = i * bm < used_ref[0]  # the tile holds rows of a group

    @pl.when(live)
    def _():
        g = tile_group_ref[i]

        def body(kb, acc):
            xq, xs = quantize_tile(x_ref[pl.ds(i * bm, bm), pl.ds(kb * BK, BK)].astype(jnp.float32))
            return acc + weight_tile_dot(xq, w_ref, (g,), kb, j, k_major) * xs * ws_ref[g, kb, j]

        acc = lax.fori_loop(0, n_kb, body, jnp.zeros((bm, BN), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def tile_layout(group_sizes, M: int, bm: int):
    """Where each sorted row goes in the tile-aligned buffer, and each tile's group.

    Returns (dest [M] row index, valid [M] bool, tile_group [tiles] int32, padded row count, rows the groups
    fill [1] int32: every tile from there on is padding)."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = (sizes + bm - 1) // bm * bm
    pstarts = jnp.cumsum(padded) - padded
    rows = jnp.arange(M, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)
    valid = rows < ends[-1]
    Mp = _round_up(M + G * (bm - 1), bm) + bm  # the last tile takes the rows past the groups
    dest = jnp.where(valid, pstarts[group] + rows - (ends[group] - sizes[group]), Mp - bm + rows % bm)
    tile_starts = jnp.arange(Mp // bm, dtype=jnp.int32) * bm
    tile_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), tile_starts, side="right"), G - 1)
    return dest, valid, tile_group.astype(jnp.int32), Mp, jnp.sum(padded)[None].astype(jnp.int32)


def grouped_tiles(tile_group, used, xp, wp, ws, *, bm: int, k_major: bool, interpret: bool):
    """The kernel over the tile-aligned buffer xp [Mp, Kp] (tile_layout): -> [Mp, Np], zeros past `used` rows."""
    Mp, Np = xp.shape[0], wp.shape[-2 if k_major else -1]
    return pl.pallas_call(
        functools.partial(_kernel, n_kb=xp.shape[1] // BK, bm=bm, k_major=k_major),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), xp.dtype),
        grid=(Mp // bm, Np // BN),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 5,
        out_specs=pl.BlockSpec((bm, BN), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(tile_group, used, xp, wp, ws)


def row_tile(M: int, groups: int) -> int:
    return 16 if M <= 8 * groups else 64  # decode-sized groups hold a few rows each


@functools.partial(jax.jit, static_argnames=("k_major", "interpret"))
def grouped_block_fp8_matmul_pallas(x, w_q, w_scale, group_sizes, k_major: bool = False, interpret: bool = False):
    """x [M, K]; w_q [G, K, N] e4m3 ([G, N, K] when k_major); w_scale [G, ceil(K/128), ceil(N/128)];
    group_sizes [G] -> [M, N]."""
    M, N = x.shape[0], w_q.shape[-2 if k_major else -1]
    bm = row_tile(M, w_q.shape[0])
    dest, valid, tile_group, Mp, used = tile_layout(group_sizes, M, bm)
    xp = jnp.zeros((Mp, x.shape[1]), x.dtype).at[dest].set(x)
    xp, wp, ws, Np = pad_operands(xp, w_q, w_scale, bm, k_major)
    out = grouped_tiles(tile_group, used, xp, wp, ws, bm=bm, k_major=k_major, interpret=interpret)
    return jnp.where(valid[:, None], out[dest, :N], 0).astype(x.dtype)
