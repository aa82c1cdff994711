"""Routed experts: the output of the experts [first_expert, first_expert + E_local) for T tokens' routes.

x [T,H]; weights, ids [T,k] (routing.route); up_gate [E_local,H,2F], down [E_local,F,H] (arrays or
BlockFP8, or tuples of consecutive expert groups) -> [T,H]. With every expert local this is the whole
routed output; under expert parallelism each device adds its own experts' share. Dropless: every
assignment to a local expert is computed, whatever the load.

Implementations, preferred first: "cpu_matvec" (matvec.py: bf16 experts, decode steps and prefill chunks of
up to ExpertOptions.matvec_max_tokens, through a compiled CPU kernel, else as "xla_cpu"; XLA:CPU where the
kernel builds), "xla_cpu" (capacity.py at decode sizes, tiled.py at prefill sizes; XLA:CPU only), "ragged"
(the reference, ragged.py: grouped matmuls whose cost follows the routed rows).
"capacity", "tiled" and "sorted_tiles" (differentiable: training) are chosen only by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops import cpu_kernels
from ernie_jax.ops.base import Implementation, Op, only_on
from ernie_jax.ops.routed_experts.capacity import capacity_experts, expert_capacities
from ernie_jax.ops.routed_experts.common import ExpertOptions, expert_groups, num_local
from ernie_jax.ops.routed_experts.matvec import matvec_experts, takes
from ernie_jax.ops.routed_experts.ragged import grouped_swiglu, ragged_experts
from ernie_jax.ops.routed_experts.routing import route, sort_by_expert, to_slots
from ernie_jax.ops.routed_experts.sorted_tiles import sorted_tile_experts
from ernie_jax.ops.routed_experts.tiled import tiled_experts


def xla_cpu_experts(x, weights, ids, up_gate, down, num_experts, first_expert, batch_invariant, opts):
    """The capacity form at decode sizes; the tiled form once the mean expert load reaches a tile (faster
    there: benchmarks/RESULTS.md, "CPU measurements behind design choices"). Block-FP8 experts and batch-invariant steps
    keep the capacity form (a tile would dequantize its expert's weights once per tile; batch invariance is
    defined on the capacity form)."""
    tiled = (not batch_invariant and isinstance(expert_groups(up_gate)[0], jax.Array)
             and ids.size >= opts.tile_rows * num_experts)
    impl = tiled_experts if tiled else capacity_experts
    return impl(x, weights, ids, up_gate, down, num_experts, first_expert, batch_invariant, opts)


def cpu_matvec_experts(x, weights, ids, up_gate, down, num_experts, first_expert, batch_invariant, opts):
    """The expert_matvec kernel for bf16 experts and at most opts.matvec_max_tokens tokens; otherwise (block-FP8
    or f32 experts, prefill sizes) the xla_cpu forms."""
    if takes(ids, up_gate, down, opts.matvec_max_tokens):
        return matvec_experts(x, weights, ids, up_gate, down, first_expert)
    return xla_cpu_experts(x, weights, ids, up_gate, down, num_experts, first_expert, batch_invariant, opts)


OP = Op("routed_experts", (
    Implementation("cpu_matvec", cpu_matvec_experts, cpu_kernels.supports("matvec"), library="matvec"),
    Implementation("xla_cpu", xla_cpu_experts, only_on("cpu", "the capacity and tiled forms are tuned for XLA:CPU")),
    Implementation("ragged", ragged_experts),
    Implementation("capacity", capacity_experts),
    Implementation("tiled", tiled_experts),
    Implementation("sorted_tiles", sorted_tile_experts),
))


def routed_experts(x, weights, ids, up_gate, down, num_experts: int, first_expert=0, batch_invariant: bool = False,
                   *, implementation: str = "ragged", opts: ExpertOptions = ExpertOptions(),
                   valid: jax.Array | None = None) -> jax.Array:
    """valid [T] bool (or None): False on padding rows. Implementations that take only their local experts'
    assignments (all but "ragged", whose grouped matmul takes every row) route them to no expert (an id of -1,
    as if another device's), so they cost no expert work and their output is 0."""
    if valid is not None and implementation != "ragged":
        ids = jnp.where(valid[:, None], ids, -1)
    return OP.get(implementation).fn(x, weights, ids, up_gate, down, num_experts, first_expert, batch_invariant,
                                     opts)


__all__ = ["OP", "ExpertOptions", "expert_capacities", "grouped_swiglu", "num_local", "route", "routed_experts",
           "sort_by_expert", "to_slots"]
