"""Grouped integer-weight matmul for MoE experts (rows sorted by expert, ragged groups) as a Pallas-Triton kernel.

The integer counterpart of grouped_fp8_matmul/pallas_triton.py, with its row layout (`tile_layout`: every
expert starts on a row-tile boundary, each tile records its expert) and its tile skipping (tiles past the rows
the experts fill store zeros without loading a row or a weight, so a device's cost follows its routed rows,
not the worst-case buffer). Each live tile runs int_weight_matmul's tile product on its expert's integers
and scales (unpacked and widened in the kernel; W4A8 in int32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ernie_jax.ops.grouped_fp8_matmul.pallas_triton import row_tile, tile_layout
from ernie_jax.ops.int_weight_matmul.pallas_triton import accumulate, k_step, launch, prepare


def _kernel(tile_group_ref, used_ref, *refs, bits: int, **kw):
    n_x = 1 if bits == 8 else 2
    x_refs, (w_ref, s_ref), rest = refs[:n_x], refs[n_x:n_x + 2], refs[n_x + 2:]
    xs_ref, o_ref = (rest[0], rest[1]) if kw["w4a8"] else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    live = i * kw["bm"] < used_ref[0]

    @pl.when(live)
    def _():
        g = tile_group_ref[i]
        o_ref[...] = accumulate(x_refs, w_ref, s_ref, xs_ref, (g,), i, j, bits=bits, **kw).astype(o_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group", "rows", "w4a8", "interpret"))
def grouped_int_matmul_pallas(x, values, scales, group_sizes, *, bits: int, group: int, rows: int,
                              w4a8: bool = False, interpret: bool = False):
    """x [M, K]; values int8 [G, K, N] (4 bits: [G, ceil(K/2), N]); scales [G, ceil(K/group), N];
    group_sizes [G] -> [M, N] in x's dtype (rows past the groups: zeros)."""
    M, N = x.shape[0], values.shape[-1]
    S, bm = k_step(group), row_tile(M, values.shape[0])
    group = -1 if group == -1 or group >= rows else group
    dest, valid, tile_group, Mp, used = tile_layout(group_sizes, M, bm)
    xp = jnp.zeros((Mp, x.shape[1]), x.dtype).at[dest].set(x)
    xops, wp, sp, xs = prepare(xp, values, scales, bits=bits, rows=rows, S=S, bm=bm, w4a8=w4a8)
    Np = wp.shape[-1]
    steps = (xops[0].shape[1] * (1 if bits == 8 else 2)) // S
    args = (tile_group, used, *xops, wp, sp) + ((xs,) if w4a8 else ())
    kernel = functools.partial(_kernel, bits=bits, steps=steps, bm=bm, S=S, group=group, w4a8=w4a8)
    out = launch(kernel, args, Mp, Np, bm, x.dtype, interpret)
    return jnp.where(valid[:, None], out[dest, :N], 0).astype(x.dtype)
