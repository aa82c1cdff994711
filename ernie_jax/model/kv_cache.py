"""A contiguous KV cache: one slot per position, one array per layer segment.

Slot p of a row holds the K/V of that row's token at position p, so writing is a scatter by position and
reading masks slots by position (layers.attention). Rows may be right-padded: a padded token writes a slot
that the row's later real tokens overwrite before any query can see it. The paged cache of the serving
engine replaces this for continuous batching; this one serves the model API and the simple generate loop.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ernie_jax.config import ErnieConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per segment [L, B, S, K, D]
    v: list[jax.Array]

    @classmethod
    def create(cls, cfg: ErnieConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        shape = lambda n: (n, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
        segs = cfg.layer_segments()
        return cls(k=[jnp.zeros(shape(s.count), dtype) for s in segs],
                   v=[jnp.zeros(shape(s.count), dtype) for s in segs])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def write(cache_k: jax.Array, cache_v: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array):
    """Store k, v [B,T,K,D] into one layer's slots [B,S,K,D] at `positions` [B,T]."""
    rows = jnp.arange(k.shape[0])[:, None]
    return cache_k.at[rows, positions].set(k.astype(cache_k.dtype)), cache_v.at[rows, positions].set(
        v.astype(cache_v.dtype))
