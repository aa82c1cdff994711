"""The jax side of paged_attention.cc: paged decode attention over a bf16 KV page pool (XLA:CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops.cpu_kernels import require
from ernie_jax.ops.paged_attention.storage import BF16_BITS


def takes(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, k_scale=None) -> bool:
    """Whether the kernel computes this call: one query token, a head dim of 16, 32, 64 or 128, and bf16 pools
    held as their bits without scales (FP8 pools and f32 ones take the XLA forms)."""
    return (q.shape[1] == 1 and q.shape[3] in (16, 32, 64, 128) and k_scale is None and k_pool.dtype == BF16_BITS
            and v_pool.dtype == BF16_BITS and k_pool.shape == v_pool.shape)


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array,
                           positions: jax.Array, block_slots: int) -> jax.Array:
    """q [B,1,N,D] at positions [B,1], pools [P,page,K,D] of bf16 bits (paged_attention/storage.py), tables
    [B,n] -> [B,1,N*D] f32; the XLA reference's math in blocks of `block_slots` key slots."""
    require("paged_attention")
    B, T, N, D = q.shape
    if not takes(q, k_pool, v_pool):
        raise ValueError(f"paged_decode_attention: one query token, head dim 16, 32, 64 or 128, over bf16-bit pools; "
                         f"got q {q.shape} and pools "
                         f"{k_pool.dtype.name} {k_pool.shape}, {v_pool.dtype.name} {v_pool.shape}")
    out = jax.ShapeDtypeStruct((B, N, D), jnp.float32)
    o = jax.ffi.ffi_call("ErnieJaxPagedDecodeAttention", out)(
        q[:, 0].astype(jnp.float32), k_pool, v_pool, tables.astype(jnp.int32), positions[:, 0].astype(jnp.int32),
        block_slots=int(block_slots))
    return o.reshape(B, 1, N * D)
