"""Paged decode attention as XLA:CPU runs it fastest: slots as they lie in the pool, heads block-diagonal.

For decode (T == 1) a gathered block is read as [B, S, K*D] and contracted over K*D with each query head
placed in its KV head's D columns and zeros elsewhere, so each head scores only its own group's slots (K
times the matmul work of one query row); the weighted values come back for every head's D columns and
each query head keeps its own. The reference's grouping of slots by head, [B,K,S,D], is a transposing copy
of every gathered page, which cost a decode step more than the K-fold matmuls on XLA:CPU. Other shapes
take the reference's form; the loop and masking are the reference's (reference.blocked_attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops.paged_attention.reference import HeadGrouped, blocked_attention


class BlockDiagonal:
    def __init__(self, q: jax.Array, K: int):
        B, _, N, D = q.shape
        R = N // K
        self.own = jnp.arange(K)[:, None] == jnp.arange(K)  # [K (query head's group), K (columns' KV head)]
        # [B,N,K*D]: head n = (g, r) holds q in the columns of KV head g, zeros in the others
        self.q = jnp.where(self.own[None, :, None, :, None], q.reshape(B, K, R, 1, D), 0).reshape(B, N, K * D)
        self.shape = (B, K, R, D)

    def scores(self, k):  # k [B,S,K,D] -> [B,K,R,1,S] f32
        B, K, R, D = self.shape
        S = k.shape[1]
        return jnp.einsum("bnx,bsx->bns", self.q, k.reshape(B, S, K * D),
                          preferred_element_type=jnp.float32).reshape(B, K, R, 1, S)

    def weighted(self, e, v):  # e [B,K,R,1,S] -> [B,K,R,1,D] f32: keep each head's own group's columns
        B, K, R, D = self.shape
        S = v.shape[1]
        o = jnp.einsum("bns,bsx->bnx", e.reshape(B, K * R, S), v.reshape(B, S, K * D),
                       preferred_element_type=jnp.float32).reshape(B, K, R, K, D)
        return jnp.sum(jnp.where(self.own[None, :, None, :, None], o, 0), axis=3)[:, :, :, None]


def paged_attention_xla_cpu(q, k_pool, v_pool, k_scale, v_scale, tables, positions, *, block_slots, constrain):
    form = BlockDiagonal if q.shape[1] == 1 and block_slots is not None else HeadGrouped
    return blocked_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, block_slots=block_slots,
                             form=form, constrain=constrain)
