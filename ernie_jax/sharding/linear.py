"""The block-FP8 matmul kernel inside sharded programs: one shard_map, each device on its own weight shard.

A pallas_call is not partitioned by GSPMD, so under a mesh the kernel runs per device. Column-parallel
weights (qkv, up_gate: output columns split) need no collective; row-parallel ones (o, down: input rows
split) take the matching slice of the activation and a psum adds the partial products, as GSPMD would.
The kernel's scales cover 128 x 128 blocks, so this applies when every split dimension splits into whole
blocks on each device and the scales are split the same way; other layouts return None, and the caller
takes the XLA path (GSPMD-partitioned), noted once in the log and the ops report (ops.base.note_fallback).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from ernie_jax.ops.base import note_fallback
from ernie_jax.ops import dense
from ernie_jax.ops.block_fp8_matmul import block_fp8_matmul
from ernie_jax.ops.dense import Matmuls
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.quant import BlockFP8
from ernie_jax.sharding.rules import LEAF_AXES, ShardingPlan

BLOCK = 128


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def placed_linear(x: jax.Array, w, ex: ExecutionConfig, plan: ShardingPlan | None, leaf: str | None) -> jax.Array:
    """x @ w as w is placed: on one device (plan None) through the execution config's matmuls; under a mesh a
    block-FP8 kernel per device on its shard where the layout allows, else the XLA reference, which GSPMD
    partitions (a kernel would not be)."""
    if plan is None:
        return dense.linear(x, w, ex.matmuls)
    if leaf is not None and isinstance(w, BlockFP8) and w.compute == "w8a8" and ex.uses_kernel("block_fp8_matmul"):
        y = fp8_linear_sharded(x, w, plan, leaf, ex.matmuls)
        if y is not None:
            return y
    return dense.linear(x, w)


def fp8_linear_sharded(x: jax.Array, w: BlockFP8, plan: ShardingPlan, leaf: str, mm: Matmuls) -> jax.Array | None:
    """x [..., K] @ w [K, N] (the weights-pytree leaf `leaf`, placed by plan) through the block-FP8 kernel
    mm.block_fp8 per device -> [..., N] in x's dtype, or None when this layout cannot run it per device."""
    specs = plan.param_spec(leaf, w)
    spec = plan.spec(LEAF_AXES[leaf], w.shape, leaf)  # [in, out] entries, whatever the storage layout
    lead = tuple(plan.spec(("batch",) + (None,) * (x.ndim - 2), x.shape[:-1]))
    why = _layout_problem(w, plan, specs, spec, lead)
    if why is not None:
        note_fallback("block_fp8_matmul", mm.block_fp8, f"{leaf} {w.shape} on mesh {dict(plan.mesh.shape)}: {why}")
        return None
    k_axes = _axes(spec[0])
    x_spec, out_spec = P(*lead, spec[0]), P(*lead, spec[1])

    def local(x, values, scales):
        y = block_fp8_matmul(x.reshape(-1, x.shape[-1]), values, scales, w.k_major, implementation=mm.block_fp8,
                             platform=mm.platform)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return lax.psum(y, k_axes) if k_axes else y
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(x_spec, specs.values, specs.scales), out_specs=out_spec,
                         check_vma=False)(x, w.values, w.scales)


def _layout_problem(w: BlockFP8, plan: ShardingPlan, specs, spec, lead) -> str | None:
    """Why the kernel cannot run per device on this layout, or None."""
    if w.block != BLOCK or w.values.ndim != 2:
        return f"block {w.block}, {w.values.ndim}-d values"
    for dim, entry, scale_entry in zip(w.shape, spec, specs.scales):
        n = plan.size_of(_axes(entry))
        if n > 1 and ((dim // n) % BLOCK or _axes(scale_entry) != _axes(entry)):
            return f"a dimension of {dim} split {n} ways is not whole {BLOCK}-blocks per device"
    if {a for e in lead for a in _axes(e)} & set(_axes(spec[0]) + _axes(spec[1])):
        return "the activation's batch split shares a mesh axis with the weight's"
    return None
