"""The paged attention kernel inside sharded programs: one shard_map, each device on its own KV heads.

A pallas_call is not partitioned by GSPMD, so under a mesh the kernel runs per device: when query and KV
heads are split over the same mesh axes (evenly) and the page pool is not split over a data axis, every
device attends its local query heads to its local KV heads, with replicated block tables and positions.
Other layouts (KV heads replicated, pools split by data) keep the XLA path (returns None).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ernie_jax import pallas as kernels
from ernie_jax.sharding.rules import ShardingPlan


def paged_attention_sharded(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions, plan: ShardingPlan):
    """q [B,T,N,D] -> [B,T,N,D], or None when this plan's layout cannot run the kernel per device."""
    axes = plan.axes_of("kv_heads")
    n = plan.size_of(axes)
    data_split = plan.size_of(tuple(a for a in plan.axes_of("batch") if plan.size_of((a,)) > 1)) > 1
    N, K = q.shape[2], k_pages.shape[2]
    if not kernels.use_kernels() or data_split or plan.axes_of("q_heads") != axes or N % n or K % n:
        return None
    ax = (axes if len(axes) > 1 else axes[0]) if axes else None
    heads, pool, scales = P(None, None, ax, None), P(None, None, ax, None), P(None, None, ax)
    fp8 = k_scale is not None
    args = [q, k_pages, v_pages] + ([k_scale, v_scale] if fp8 else []) + [block_tables, positions]
    specs = [heads, pool, pool] + ([scales, scales] if fp8 else []) + [P(), P()]

    def local(q, k, v, *rest):
        ks, vs = (rest[0], rest[1]) if fp8 else (None, None)
        return kernels.paged_attention(q, k, v, ks, vs, rest[-2], rest[-1])
    return jax.shard_map(local, mesh=plan.mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(*args)
