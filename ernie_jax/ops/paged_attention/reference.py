"""The XLA reference of paged attention: a blocked online softmax over each sequence's pages.

q [B,T,N,D] at positions [B,T] (-1: padding); k_pool, v_pool [P,page,K,D] (fp8 with scales [P,page,K],
or None); tables [B,n]: slot j of row b is page tables[b, j // page]. Key slot j of a row is visible to
its query at position p iff j <= p (causal by position). The loop walks blocks of `block_slots` slots
and stops after the block holding the batch's largest position, so a step costs what the sequences hold,
not the block tables' capacity; later blocks would be fully masked and change nothing, so a row's result
does not depend on the others in its batch. block_slots None reads the whole table in one block (under a
mesh, where `constrain` pins each gathered block's sharding to the cache's KV-head layout).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.ops.paged_attention.storage import loaded

_NEG_INF = -1e30


class HeadGrouped:
    """Scores and weighted values with query heads grouped by KV head: q as [B,T,K,R,D]."""

    def __init__(self, q: jax.Array, K: int):
        B, T, N, D = q.shape
        self.q = q.reshape(B, T, K, N // K, D)

    def scores(self, k):  # k [B,S,K,D] -> [B,K,R,T,S] f32
        return jnp.einsum("btkrd,bskd->bkrts", self.q, k, preferred_element_type=jnp.float32)

    def weighted(self, e, v):  # e [B,K,R,T,S], v [B,S,K,D] -> [B,K,R,T,D] f32
        return jnp.einsum("bkrts,bskd->bkrtd", e, v, preferred_element_type=jnp.float32)


def blocked_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, *, block_slots: int | None,
                      form=HeadGrouped, constrain: Callable = lambda x: x) -> jax.Array:
    """-> [B,T,N*D] in q's dtype. `form(q, K)` supplies scores() and weighted() (HeadGrouped, or a backend's
    own contraction of the same math)."""
    B, T, N, D = q.shape
    page, K = k_pool.shape[1], k_pool.shape[2]
    R = N // K
    n = tables.shape[1]
    bp = n if block_slots is None else max(1, min(n, block_slots // page))
    nb = -(-n // bp)
    tables = jnp.pad(tables, ((0, 0), (0, nb * bp - n)))  # past the end: masked by position
    S = bp * page
    f = form(q, K)

    def gather(pool, scale, ids):  # -> [B,S,K,D] in q's dtype
        x = loaded(pool[ids])  # [B,bp,page,K,D]
        if scale is not None:
            x = x.astype(jnp.float32) * scale[ids][..., None]
        return constrain(x.reshape(B, S, K, D).astype(q.dtype))

    def body(i, carry):
        m, denom, acc = carry  # [B,K,R,T], [B,K,R,T], [B,K,R,T,D] f32
        ids = lax.dynamic_slice_in_dim(tables, i * bp, bp, axis=1)
        k, v = gather(k_pool, k_scale, ids), gather(v_pool, v_scale, ids)
        s = f.scores(k) * (D ** -0.5)
        visible = (i * S + jnp.arange(S)[None, None, :] <= positions[:, :, None])[:, None, None]  # [B,1,1,T,S]
        s = jnp.where(visible, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(s - m_new[..., None])
        return m_new, denom * alpha + jnp.sum(e, axis=-1), acc * alpha[..., None] + f.weighted(e.astype(v.dtype), v)

    init = (jnp.full((B, K, R, T), _NEG_INF, jnp.float32), jnp.zeros((B, K, R, T), jnp.float32),
            jnp.zeros((B, K, R, T, D), jnp.float32))
    if nb == 1:
        _, denom, acc = body(0, init)
    else:
        _, denom, acc = lax.fori_loop(0, jnp.clip(jnp.max(positions) // S + 1, 1, nb), body, init)
    o = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B,K,R,T,D]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N * D).astype(q.dtype)
