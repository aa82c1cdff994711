"""The paged KV cache: a pool of fixed-size pages per layer segment, addressed through block tables; bf16 or FP8.

Arrays per segment: k, v [L, P, page, K, D]. A sequence owns a list of pages (its block-table row [n]);
its token at position p lives in page block_table[p // page] at offset p % page. Writing scatters the new
tokens there; attention (ops/paged_attention) reads the pages through the
block table (unsharded, only as far as the query positions reach), slot j holding position j, and masks
slots by position, so unwritten slots (and garbage pages behind unused block-table entries) are never seen. A
contiguous cache is the special case of one page per sequence (`create(cfg, batch, max_len)` with block
table row b = [b]). Right-padded tokens write slots that the sequence's later real tokens overwrite
before any query can see them.

A bf16 pool may be stored as its uint16 bits (ops/paged_attention/storage.py, the execution config's
kv_bf16_bits); `stored` converts on the way in, and readers convert back by the pool's dtype.

FP8 (`kv_cache_dtype="fp8"`): e4m3fn values plus one f32 dequant scale per (token, KV head). The scale is
dynamic (amax over the head dim / 448, FastDeploy's block_wise_fp8 cache) unless the checkpoint ships
static per-KV-head scales (`cachek_matmul.activation_scale`, FastDeploy's float8_e4m3fn cache), which are
then written into the same slots: one read path serves both. Writes saturate at +-448.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ernie_jax.config import ErnieConfig
from ernie_jax.ops.paged_attention.storage import stored
from ernie_jax.quant import FP8, FP8_MAX
from ernie_jax.sharding.rules import KV_HEADS

KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "auto": None, "float32": jnp.float32,
                   "fp8": FP8, "fp8_e4m3": FP8}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per segment [L, P, page, K, D]
    v: list[jax.Array]
    k_scale: list[jax.Array] | None = None  # fp8 only: per segment [L, P, page, K] f32
    v_scale: list[jax.Array] | None = None

    @classmethod
    def create(cls, cfg: ErnieConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, mtp: bool = False
               ) -> "KVCache":
        """mtp: one more segment, of one layer, after the decoder's: the MTP block's KV (speculative decoding),
        in the same pages, so it moves, is freed and is cached with the sequence's."""
        counts = [s.count for s in cfg.layer_segments()] + ([1] if mtp else [])
        shape = lambda n: (n, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
        k = [jnp.zeros(shape(n), dtype) for n in counts]
        v = [jnp.zeros(shape(n), dtype) for n in counts]
        if jnp.dtype(dtype) != jnp.dtype(FP8):
            return cls(k, v)
        ones = lambda n: jnp.ones(shape(n)[:-1], jnp.float32)  # noqa: E731
        return cls(k, v, [ones(n) for n in counts], [ones(n) for n in counts])

    @property
    def num_segments(self) -> int:
        return len(self.k)

    def shardings(self, plan) -> "KVCache":
        """NamedShardings for this cache under a ShardingPlan: KV heads over tensor (pages over data)."""
        return jax.tree.map(lambda a: plan.activation(KV_HEADS[: a.ndim - 1], a.shape), self)

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(self))

    def segment(self, s: int) -> dict[str, jax.Array]:
        seg = {"k": self.k[s], "v": self.v[s]}
        if self.is_fp8:
            seg.update(k_scale=self.k_scale[s], v_scale=self.v_scale[s])
        return seg

    @classmethod
    def from_segments(cls, segs: list[dict[str, jax.Array]]) -> "KVCache":
        scales = "k_scale" in segs[0]
        return cls([s["k"] for s in segs], [s["v"] for s in segs],
                   [s["k_scale"] for s in segs] if scales else None, [s["v_scale"] for s in segs] if scales else None)


def _quantize(x: jax.Array, static_scale: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """x [B,T,K,D] -> (fp8 values, dequant scales [B,T,K])."""
    xf = x.astype(jnp.float32)
    if static_scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), 1e-10) / FP8_MAX
    else:
        scale = jnp.broadcast_to(static_scale.astype(jnp.float32), xf.shape[:-1])
    return jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8), scale


def write(seg: dict[str, jax.Array], layer: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
          block_tables: jax.Array, static_scales: tuple[jax.Array | None, jax.Array | None] = (None, None)
          ) -> dict[str, jax.Array]:
    """Store k, v [B,T,K,D] of segment layer `layer` at `positions` [B,T] through `block_tables` [B,n].

    The segment's stacked arrays are updated in place (a scatter into the scan carry, which a donated
    cache turns into an in-place write), so a step never copies the cache."""
    page_size = seg["k"].shape[2]
    pages = jnp.take_along_axis(block_tables, positions // page_size, axis=1)  # [B,T]
    offsets = positions % page_size
    out = dict(seg)
    for name, x, static in (("k", k, static_scales[0]), ("v", v, static_scales[1])):
        if f"{name}_scale" in seg:
            x, scale = _quantize(x, static)
            out[f"{name}_scale"] = seg[f"{name}_scale"].at[layer, pages, offsets].set(scale)
        out[name] = seg[name].at[layer, pages, offsets].set(stored(x, seg[name].dtype))
    return out


def layer_pages(seg: dict[str, jax.Array], layer: jax.Array, block_tables: jax.Array
                ) -> tuple[Callable[[str], jax.Array], jax.Array]:
    """One layer's pages without slicing them out: (name -> the segment's pool with layers and pages
    flattened [L*P, page, ...], the block tables offset to that layer's pages). `seg["k"][layer]` would
    copy the layer's whole pool on every layer of every step."""
    num_pages = seg["k"].shape[1]
    flat = lambda name: seg[name].reshape(-1, *seg[name].shape[2:])  # noqa: E731 -- a bitcast, no copy
    return flat, block_tables + layer * num_pages


def identity_block_tables(batch: int) -> jax.Array:
    """Block tables of a contiguous cache (`KVCache.create(cfg, batch, max_len)`): row b owns page b."""
    return jnp.arange(batch, dtype=jnp.int32)[:, None]
