"""GQA attention over a paged KV cache (bf16 or FP8 with per-token-head scales) as a Pallas-Triton GPU kernel.

One kernel serves decode (one query token per sequence) and chunked prefill (a chunk of T query tokens):
each program takes a tile of query tokens of one sequence and all R = N/K query heads of one KV head (rows
= tokens x heads), walks the sequence's pages through its block-table row, only as far as the tile's last
position needs, dequantizes FP8 K/V with their scales on the fly, and keeps a flash-style online softmax.
A key slot is visible to a row iff slot <= that row's position (causal by position), so lengths need not
be multiples of the page size and unused block-table entries are never read. Heads are padded to a power
of two and rows to at least 16, the smallest MMA tile. Backend: Pallas-Triton (see block_fp8_matmul/pallas_triton.py). FP8
K/V are dequantized to f32 before the dots, so the kernel needs no FP8 MMA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_NEG = -1e30


def _kernel(tables_ref, q_ref, pos_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, *, page: int, fp8: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)  # [rows, D], scaled by D^-0.5; rows = tokens x heads of this tile
    pos = pos_ref[...]  # [rows, 1]: each row's query position (-1 for padding rows)
    slot = lax.broadcasted_iota(jnp.int32, (1, page), 1)

    def body(p, carry):
        m, l, acc = carry
        pid = tables_ref[b, p]
        k = k_ref[pid, :, h, :].astype(jnp.float32)  # [page, D]
        v = v_ref[pid, :, h, :].astype(jnp.float32)
        if fp8:
            k = k * ks_ref[pid, :, h][:, None]
            v = v * vs_ref[pid, :, h][:, None]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [rows, page]
        s = jnp.where(p * page + slot <= pos, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new)
        return m_new, l * alpha + jnp.sum(e, axis=1, keepdims=True), acc * alpha + jnp.dot(
            e, v, preferred_element_type=jnp.float32)

    rows, D = q.shape
    init = (jnp.full((rows, 1), _NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32), jnp.zeros((rows, D), jnp.float32))
    n_pages = jnp.max(pos) // page + 1
    _, l, acc = lax.fori_loop(0, n_pages, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_attention_pallas(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions, interpret: bool = False):
    """q [B, T, N, D] at `positions` [B, T] (-1: a padding token); k_pages, v_pages [P, page, K, D];
    k_scale, v_scale [P, page, K] f32 or None (bf16 cache); block_tables [B, n] -> [B, T, N, D]."""
    B, T, N, D = q.shape
    P, page, K, _ = k_pages.shape
    R = N // K
    Rp = 1 << (R - 1).bit_length()
    bt = 1 if T == 1 else min(1 << (T - 1).bit_length(), max(1, 64 // Rp))  # tokens per tile
    Rp = max(Rp, 16 // bt)  # at least 16 rows per tile
    Tp = -(-T // bt) * bt
    qg = (q.astype(jnp.float32) * D ** -0.5).reshape(B, T, K, R, D).transpose(0, 2, 1, 3, 4)  # [B,K,T,R,D]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Tp - T), (0, Rp - R), (0, 0))).reshape(B, K, Tp * Rp, D)
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)
    pos = jnp.repeat(pos, Rp, axis=1)[..., None]  # [B, Tp*Rp, 1], row = token * Rp + head
    fp8 = k_scale is not None
    if not fp8:  # one kernel signature: these scales are never read
        k_scale = v_scale = jnp.ones((1, 1, 1), jnp.float32)
    rows = bt * Rp
    out = pl.pallas_call(
        functools.partial(_kernel, page=page, fp8=fp8),
        out_shape=jax.ShapeDtypeStruct((B, K, Tp * Rp, D), q.dtype),
        grid=(B, K, Tp // bt),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((None, None, rows, D), lambda b, h, t: (b, h, t, 0)),
                  pl.BlockSpec((None, rows, 1), lambda b, h, t: (b, t, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * 4,
        out_specs=pl.BlockSpec((None, None, rows, D), lambda b, h, t: (b, h, t, 0)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(block_tables.astype(jnp.int32), qg, pos, k_pages, v_pages, k_scale, v_scale)
    out = out.reshape(B, K, Tp, Rp, D)[:, :, :T, :R].transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, N, D)
