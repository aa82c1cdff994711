"""The quantized-matmul kernels inside sharded programs: one shard_map, each device on its own weight shard.

A pallas_call is not partitioned by GSPMD, so under a mesh a kernel runs per device. Column-parallel
weights (qkv, up_gate: output columns split) need no collective; row-parallel ones (o, down: input rows
split) take the matching slice of the activation and a psum adds the partial products, as GSPMD would.
This applies when every split dimension splits into whole scale blocks on each device and the scales are
split the same way: a block-FP8 weight's 128 x 128 blocks; an integer weight's scale groups (its `in` axis
splits only where rules.param_spec split values and scales alike; a 4-bit weight's packed rows hold two
input rows each). Other layouts return None, and the caller takes the XLA path (GSPMD-partitioned), noted
once in the log and the ops report (ops.base.note_fallback). W4A8 weights are never split along `in` here
(a device would quantize its slice of a token with its own scale): they take the XLA path when they are.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from ernie_jax.ops.base import note_fallback
from ernie_jax.ops import dense
from ernie_jax.ops.block_fp8_matmul import block_fp8_matmul
from ernie_jax.ops.dense import Matmuls
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.ops.int_weight_matmul import int_weight_matmul, kernel_limit
from ernie_jax.quant import BlockFP8, IntWeight
from ernie_jax.sharding.rules import LEAF_AXES, ShardingPlan

BLOCK = 128


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def placed_linear(x: jax.Array, w, ex: ExecutionConfig, plan: ShardingPlan | None, leaf: str | None) -> jax.Array:
    """x @ w as w is placed: on one device (plan None) through the execution config's matmuls; under a mesh a
    quantized kernel per device on its shard where the layout allows, else the XLA reference, which GSPMD
    partitions (a kernel would not be)."""
    if plan is None:
        return dense.linear(x, w, ex.matmuls)
    if leaf is not None and _kernel_op(w, ex) is not None:
        y = kernel_linear_sharded(x, w, plan, leaf, ex.matmuls)
        if y is not None:
            return y
    return dense.linear(x, w)


def _kernel_op(w, ex: ExecutionConfig) -> str | None:
    """The kernel op that would run w's matmul, or None when its matmul takes no kernel."""
    if isinstance(w, BlockFP8) and w.compute == "w8a8" and ex.uses_kernel("block_fp8_matmul"):
        return "block_fp8_matmul"
    if isinstance(w, IntWeight) and ex.uses_kernel("int_weight_matmul"):
        return "int_weight_matmul"
    return None


def kernel_linear_sharded(x: jax.Array, w, plan: ShardingPlan, leaf: str, mm: Matmuls) -> jax.Array | None:
    """x [..., K] @ w [K, N] (the weights-pytree leaf `leaf`, placed by plan) through the quantized kernel per
    device -> [..., N] in x's dtype, or None when this layout cannot run it per device."""
    specs = plan.param_spec(leaf, w)
    spec = plan.spec(LEAF_AXES[leaf], w.shape, leaf)  # [in, out] entries, whatever the storage layout
    lead = tuple(plan.spec(("batch",) + (None,) * (x.ndim - 2), x.shape[:-1]))
    fp8 = isinstance(w, BlockFP8)
    why = _layout_problem(w, plan, specs, spec, lead)
    if why is not None:
        op, impl = ("block_fp8_matmul", mm.block_fp8) if fp8 else ("int_weight_matmul", mm.int_weight)
        note_fallback(op, impl, f"{leaf} {w.shape} on mesh {dict(plan.mesh.shape)}: {why}")
        return None
    k_axes = _axes(spec[0])
    x_spec, out_spec = P(*lead, spec[0]), P(*lead, spec[1])
    local_rows = w.shape[0] // plan.size_of(k_axes)

    def local(x, values, scales):
        x2 = x.reshape(-1, x.shape[-1])
        if fp8:
            y = block_fp8_matmul(x2, values, scales, w.k_major, implementation=mm.block_fp8, platform=mm.platform)
        else:
            shard = dataclasses.replace(w, values=values, scales=scales, rows=local_rows)
            y = int_weight_matmul(x2, shard, implementation=mm.int_weight, platform=mm.platform)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return lax.psum(y, k_axes) if k_axes else y
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(x_spec, specs.values, specs.scales), out_specs=out_spec,
                         check_vma=False)(x, w.values, w.scales)


def _layout_problem(w, plan: ShardingPlan, specs, spec, lead) -> str | None:
    """Why the kernel cannot run per device on this layout, or None."""
    if w.values.ndim != 2:
        return f"{w.values.ndim}-d values"
    if isinstance(w, BlockFP8):
        if w.block != BLOCK:
            return f"block {w.block}"
        for dim, entry, scale_entry in zip(w.shape, spec, specs.scales):
            n = plan.size_of(_axes(entry))
            if n > 1 and ((dim // n) % BLOCK or _axes(scale_entry) != _axes(entry)):
                return f"a dimension of {dim} split {n} ways is not whole {BLOCK}-blocks per device"
    else:
        if why := kernel_limit(w):
            return why
        k_split = plan.size_of(_axes(specs.values[0]))
        if plan.size_of(_axes(spec[0])) != k_split or plan.size_of(_axes(spec[1])) != plan.size_of(
                _axes(specs.values[1])):
            return "the rules split its packed rows or columns otherwise than its logical ones"
        if k_split > 1:
            K = w.shape[0]
            group = K if w.per_channel else w.group
            if K % (k_split * (2 if w.bits == 4 else 1)) or w.compute == "w4a8" or (
                    not w.per_channel and (K // k_split) % group):
                return f"its {K} input rows do not split {k_split} ways into whole scale groups (or it is W4A8)"
    if {a for e in lead for a in _axes(e)} & set(_axes(spec[0]) + _axes(spec[1])):
        return "the activation's batch split shares a mesh axis with the weight's"
    return None
