"""GQA attention over a paged KV cache (bf16 or FP8 with per-token-head scales) as a Pallas-Triton GPU kernel.

One kernel serves decode (one query token per sequence) and chunked prefill (a chunk of T query tokens):
each program takes a tile of query tokens of one sequence and all R = N/K query heads of one KV head (rows
= tokens x heads), walks the sequence's pages through its block-table row, only as far as the tile's last
position needs, dequantizes FP8 K/V with their scales on the fly, and keeps a flash-style online softmax.
A key slot is visible to a row iff slot <= that row's position (causal by position), so lengths need not
be multiples of the page size and unused block-table entries are never read. Heads are padded to a power
of two and rows to at least 16, the smallest MMA tile.

Decode (T = 1) splits each sequence's pages over several programs (flash-decoding): B x K programs alone
leave most of a GPU idle at small batch (B 8, one KV head per device under TP8: 8 programs on 132 SMs),
so each of S programs per (sequence, KV head) walks its own range of pages and leaves its partial
(max, sum, weighted values); a log-sum-exp combine in XLA merges the S partials. Backend: Pallas-Triton (see block_fp8_matmul/pallas_triton.py). FP8
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


def _attend(tables_ref, q, pos, k_ref, v_ref, ks_ref, vs_ref, b, h, first, end, *, page: int, fp8: bool):
    """Online softmax of q [rows, D] over pages first..end-1 of sequence b, KV head h -> (max [rows, 1],
    sum [rows, 1], unnormalised weighted values [rows, D]), all f32."""
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
    return lax.fori_loop(first, end, body, init)


def _kernel(tables_ref, q_ref, pos_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, *, page: int, fp8: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)  # [rows, D], scaled by D^-0.5; rows = tokens x heads of this tile
    pos = pos_ref[...]  # [rows, 1]: each row's query position (-1 for padding rows)
    _, l, acc = _attend(tables_ref, q, pos, k_ref, v_ref, ks_ref, vs_ref, b, h, 0, jnp.max(pos) // page + 1,
                        page=page, fp8=fp8)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


def _split_kernel(tables_ref, q_ref, pos_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, m_ref, l_ref, *, page: int,
                  fp8: bool, pages_per_split: int):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q, pos = q_ref[...].astype(jnp.float32), pos_ref[...]
    first = s * pages_per_split
    end = jnp.minimum(first + pages_per_split, jnp.max(pos) // page + 1)  # empty past the sequence
    m, l, acc = _attend(tables_ref, q, pos, k_ref, v_ref, ks_ref, vs_ref, b, h, first, end, page=page, fp8=fp8)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def kv_splits(batch: int, kv_heads: int, table_pages: int, programs: int = 256) -> int:
    """Programs per (sequence, KV head) for decode: enough for about `programs` in all, at most one per page."""
    return max(1, min(table_pages, -(-programs // (batch * kv_heads))))


def _decode_split(tables, qg, pos, k_pages, v_pages, k_scale, v_scale, *, splits: int, page: int, fp8: bool,
                  interpret: bool):
    """Split-KV decode: qg [B, K, rows, D] -> [B, K, rows, D] f32."""
    B, K, rows, D = qg.shape
    pps = -(-tables.shape[1] // splits)
    part = lambda *tail: jax.ShapeDtypeStruct((B, K, splits, rows, *tail), jnp.float32)  # noqa: E731
    spec = lambda *tail: pl.BlockSpec((None, None, None, rows, *tail), lambda b, h, s: (b, h, s, 0, 0))  # noqa: E731
    acc, m, l = pl.pallas_call(
        functools.partial(_split_kernel, page=page, fp8=fp8, pages_per_split=pps),
        out_shape=(part(D), part(1), part(1)),
        grid=(B, K, splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((None, None, rows, D), lambda b, h, s: (b, h, 0, 0)),
                  pl.BlockSpec((None, rows, 1), lambda b, h, s: (b, 0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * 4,
        out_specs=(spec(D), spec(1), spec(1)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(tables, qg, pos, k_pages, v_pages, k_scale, v_scale)
    top = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - top)  # [B, K, S, rows, 1]: empty splits weigh exp(-1e30 - max) = 0
    return jnp.sum(w * acc, axis=2) / jnp.maximum(jnp.sum(w * l, axis=2), 1e-30)


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
    tables = block_tables.astype(jnp.int32)
    splits = kv_splits(B, K, tables.shape[1]) if T == 1 else 1
    if splits > 1:
        out = _decode_split(tables, qg, pos, k_pages, v_pages, k_scale, v_scale, splits=splits, page=page, fp8=fp8,
                            interpret=interpret).astype(q.dtype)
    else:
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
        )(tables, qg, pos, k_pages, v_pages, k_scale, v_scale)
    out = out.reshape(B, K, Tp, Rp, D)[:, :, :T, :R].transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, N, D)
