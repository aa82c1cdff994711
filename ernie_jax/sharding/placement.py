"""Putting weights and caches onto a mesh, and counting what each device holds.

`shard_weights` builds every sharded array from its host copy shard by shard
(`jax.make_array_from_callback`), so no device ever holds a full copy of a tensor it only owns a slice of;
fused [Q|K|V] and [gate|up] leaves are first re-laid in the plan's groups (fused.py).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from ernie_jax.config import ErnieConfig
from ernie_jax.sharding.fused import relayout_fused
from ernie_jax.sharding.rules import ShardingPlan


def shard_weights(weights: Any, plan: ShardingPlan, cfg: ErnieConfig) -> Any:
    """The checkpoint-layout weights pytree placed on plan.mesh, in plan's fused layout."""
    weights = relayout_fused(weights, plan, cfg)
    shardings = plan.shardings(weights)

    def place(x, sharding):
        host = np.asarray(x) if not isinstance(x, jax.Array) else x
        if isinstance(host, jax.Array):
            return jax.device_put(host, sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx], dtype=host.dtype)
    return jax.tree.map(place, weights, shardings)


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of `tree` resident on each device (addressable shards of concrete arrays)."""
    out: dict[str, int] = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[str(shard.device)] += shard.data.nbytes
    return dict(out)


def abstract_device_bytes(abstract: Any, shardings: Any) -> int:
    """Per-device bytes of an abstract pytree under `shardings` (the largest shard of each leaf)."""
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        shard = s.shard_shape(tuple(x.shape))
        total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total
