"""GQA decode attention over a paged KV cache (bf16 or FP8 with per-token-head scales), Pallas GPU kernel +
XLA reference.

One program per (sequence, KV head): it walks the sequence's pages through its block-table row, only as
many as its length needs, dequantizes FP8 K/V with their scales on the fly, and keeps an online softmax
(running max and sum) over the R = N/K query heads of that KV head. Slots at or past the length are
masked, so lengths need not be multiples of the page size and unused block-table entries are never read.
Query heads are padded to 16 rows, the smallest MMA tile. Backend: Pallas-Triton (see block_fp8_matmul.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_NEG = -1e30


def _kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, ks_ref, vs_ref, o_ref, *, page: int, fp8: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)  # [Rp, D], already scaled by D^-0.5
    length = lengths_ref[b]
    slot = lax.broadcasted_iota(jnp.int32, (1, page), 1)

    def body(p, carry):
        m, l, acc = carry
        pid = tables_ref[b, p]
        k = k_ref[pid, :, h, :].astype(jnp.float32)  # [page, D]
        v = v_ref[pid, :, h, :].astype(jnp.float32)
        if fp8:
            k = k * ks_ref[pid, :, h][:, None]
            v = v * vs_ref[pid, :, h][:, None]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [Rp, page]
        s = jnp.where(p * page + slot < length, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new)
        return m_new, l * alpha + jnp.sum(e, axis=1, keepdims=True), acc * alpha + jnp.dot(
            e, v, preferred_element_type=jnp.float32)

    Rp, D = q.shape
    init = (jnp.full((Rp, 1), _NEG, jnp.float32), jnp.zeros((Rp, 1), jnp.float32), jnp.zeros((Rp, D), jnp.float32))
    _, l, acc = lax.fori_loop(0, (length + page - 1) // page, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_decode_attention_pallas(q, k_pages, v_pages, k_scale, v_scale, block_tables, lengths,
                                  interpret: bool = False):
    """q [B, N, D]; k_pages, v_pages [P, page, K, D]; k_scale, v_scale [P, page, K] f32 or None (bf16 cache);
    block_tables [B, n] int32; lengths [B] (tokens in the cache, the current one included) -> [B, N, D]."""
    B, N, D = q.shape
    P, page, K, _ = k_pages.shape
    R = N // K
    Rp = max(16, 1 << (R - 1).bit_length())
    qg = (q.astype(jnp.float32) * D ** -0.5).reshape(B, K, R, D)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    fp8 = k_scale is not None
    if not fp8:  # one kernel signature: unit scales are never read
        k_scale = v_scale = jnp.ones((1, 1, 1), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_kernel, page=page, fp8=fp8),
        out_shape=jax.ShapeDtypeStruct((B, K, Rp, D), q.dtype),
        grid=(B, K),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((None, None, Rp, D), lambda b, h: (b, h, 0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * 4,
        out_specs=pl.BlockSpec((None, None, Rp, D), lambda b, h: (b, h, 0, 0)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg, k_pages, v_pages, k_scale, v_scale)
    return out[:, :, :R].reshape(B, N, D)


def paged_decode_attention_reference(q, k_pages, v_pages, k_scale, v_scale, block_tables, lengths):
    """The XLA path: gather the pages, dequantize, and run the model's attention (layers.attention)."""
    from ernie_jax.model.layers import attention
    B, N, D = q.shape
    n, page = block_tables.shape[1], k_pages.shape[1]

    def gather(pages, scale):
        x = pages[block_tables].astype(jnp.float32)  # [B, n, page, K, D]
        if scale is not None:
            x = x * scale[block_tables][..., None]
        return x.reshape(B, n * page, *x.shape[3:])
    slots = jnp.broadcast_to(jnp.arange(n * page), (B, n * page))
    out = attention(q[:, None].astype(jnp.float32), gather(k_pages, k_scale), gather(v_pages, v_scale),
                    (lengths - 1)[:, None], slots)
    return out.reshape(B, N, D).astype(q.dtype)
