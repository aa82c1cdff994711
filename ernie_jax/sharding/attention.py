"""The paged attention kernel inside sharded programs: one shard_map, each device on its own KV heads.

A pallas_call is not partitioned by GSPMD, so under a mesh the kernel runs per device: when query and KV
heads are split over the same mesh axes (evenly) and the page pool is not split over a data axis, every
device attends its local query heads to its local KV heads, with replicated block tables and positions.
Where the KV heads do not split over the devices, the rules replicate the pool, and every device attends
all heads to its own copy (repeated work, no collective). The XLA:CPU implementation runs the same way:
per device it walks only the blocks up to the batch's largest position, where GSPMD's form reads every
sequence's whole block table. Other layouts (pools split by data, query and KV heads split differently)
return None, noted once in the log and the ops report; the caller then takes the GSPMD XLA path.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ernie_jax.ops import paged_attention as attention_op
from ernie_jax.ops.base import Platform, note_fallback
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.sharding.rules import ShardingPlan


def placed_paged_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, ex: ExecutionConfig,
                           plan: ShardingPlan | None, constrain=lambda x: x) -> jax.Array:
    """Paged attention q [B,T,N,D] -> [B,T,N*D] as the pool is placed: on one device (plan None) the execution
    config's implementation; under a mesh a kernel (or XLA:CPU's form) per device over its KV heads where the
    layout allows, else the XLA form over the whole table in one block, with `constrain` pinning the gathered
    slots to the cache's head layout: a loop over blocks would gather pages from the other devices on every
    iteration and make XLA copy the pool around the loop (benchmarks/RESULTS.md, "CPU measurements behind
    design choices")."""
    args = (q, k_pool, v_pool, k_scale, v_scale, tables, positions)
    if plan is None:
        return attention_op.paged_attention(*args, implementation=ex.paged_attention,
                                            block_slots=ex.attention_block_slots, platform=ex.platform)
    if ex.paged_attention != "xla":
        out = paged_attention_sharded(*args, plan, ex.paged_attention, ex.platform)
        if out is not None:
            return out
    return attention_op.paged_attention(*args, implementation="xla", block_slots=None, constrain=constrain)


def paged_attention_sharded(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions, plan: ShardingPlan,
                            implementation: str, platform: Platform):
    """q [B,T,N,D] -> [B,T,N*D], or None when this plan's layout cannot run the kernel per device."""
    axes = plan.axes_of("kv_heads")
    n = plan.size_of(axes)
    data_split = plan.size_of(tuple(a for a in plan.axes_of("batch") if plan.size_of((a,)) > 1)) > 1
    N, K = q.shape[2], k_pages.shape[2]
    replicated = not data_split and K % n != 0  # the rules replicate a pool whose KV heads do not split
    why = ("the page pool is split over a data axis" if data_split else None if replicated else
           f"query heads split over {plan.axes_of('q_heads')}, KV heads over {axes}"
           if plan.axes_of("q_heads") != axes else f"{N} query heads do not split {n} ways" if N % n else None)
    if why is not None:
        note_fallback("paged_attention", implementation, f"mesh {dict(plan.mesh.shape)}: {why}")
        return None
    if replicated:  # every device attends all heads to its own copy of the pool (no collective)
        note_fallback("paged_attention", implementation, f"mesh {dict(plan.mesh.shape)}: {K} KV heads do not "
                      f"split {n} ways, so every device attends all heads")
        heads, pool, scales = P(), P(), P()
    elif not axes:  # the rules split no axis over the KV heads (dp_attn_ep with data=1): each device has them all
        heads, pool, scales = P(), P(), P()
    else:
        ax = axes if len(axes) > 1 else axes[0]
        heads, pool, scales = P(None, None, ax, None), P(None, None, ax, None), P(None, None, ax)
    fp8 = k_scale is not None
    args = [q, k_pages, v_pages] + ([k_scale, v_scale] if fp8 else []) + [block_tables, positions]
    specs = [heads, pool, pool] + ([scales, scales] if fp8 else []) + [P(), P()]

    def local(q, k, v, *rest):
        ks, vs = (rest[0], rest[1]) if fp8 else (None, None)
        B, T, Nl, D = q.shape
        out = attention_op.paged_attention(q, k, v, ks, vs, rest[-2], rest[-1], implementation=implementation,
                                           platform=platform)
        return out.reshape(B, T, Nl, D)
    out = jax.shard_map(local, mesh=plan.mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(*args)
    return out.reshape(*out.shape[:2], -1)
