"""The reference routed experts: assignments sorted by expert, one grouped (ragged) matmul per projection.

The cost follows the routed rows, which is what accelerators want; block-FP8 experts run the
grouped_fp8_matmul op, integer experts the grouped_int_matmul op. XLA:CPU runs ragged_dot as a dense loop over every group on every row (docs/xla-notes.md N3),
which is why CPUs take xla_cpu.py's forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.ops.dense import Matmuls, silu_mul
from ernie_jax.ops.grouped_fp8_matmul import grouped_fp8_matmul
from ernie_jax.ops.grouped_int_matmul import grouped_int_matmul
from ernie_jax.ops.routed_experts.common import ExpertOptions, combine, num_local
from ernie_jax.ops.routed_experts.routing import sort_by_expert
from ernie_jax.quant import BlockFP8, IntWeight, fp8_ragged_dot


def ragged_dot(x: jax.Array, w, group_sizes: jax.Array, mm: Matmuls) -> jax.Array:
    if isinstance(w, BlockFP8):
        if w.compute == "w8a8":
            return grouped_fp8_matmul(x, w.values, w.scales, group_sizes, w.k_major, implementation=mm.grouped_fp8,
                                      platform=mm.platform, block=w.block)
        return fp8_ragged_dot(x, w, group_sizes)
    if isinstance(w, IntWeight):
        return grouped_int_matmul(x, w, group_sizes, implementation=mm.grouped_int, platform=mm.platform)
    return lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)


def grouped_swiglu(xs: jax.Array, up_gate, down, group_sizes: jax.Array, mm: Matmuls = Matmuls()) -> jax.Array:
    """SwiGLU experts over rows sorted by expert: xs [M,H], up_gate [E,H,2F], down [E,F,H] (or tuples of
    consecutive expert groups)."""
    up_gate, down = (jnp.concatenate(w) if isinstance(w, tuple) else w for w in (up_gate, down))
    u = ragged_dot(xs, up_gate, group_sizes, mm)
    return ragged_dot(silu_mul(*jnp.split(u.astype(xs.dtype), 2, axis=-1)), down, group_sizes, mm).astype(xs.dtype)


def ragged_experts(x, weights, ids, up_gate, down, num_experts: int, first_expert, batch_invariant: bool,
                   opts: ExpertOptions) -> jax.Array:
    T, k = ids.shape
    local = num_local(up_gate)
    order, inverse, sizes = sort_by_expert(ids, num_experts)
    xs = x[order // k]
    if local == num_experts:
        ys = grouped_swiglu(xs, up_gate, down, sizes, opts.matmuls)
    else:
        # The local experts' rows are contiguous in expert order: rotate them to the front, run the grouped
        # matmul on the local groups only, rotate back and zero every other expert's rows.
        start = jnp.sum(jnp.where(jnp.arange(num_experts) < first_expert, sizes, 0))
        local_sizes = lax.dynamic_slice_in_dim(sizes, first_expert, local)
        ys = jnp.roll(grouped_swiglu(jnp.roll(xs, -start, axis=0), up_gate, down, local_sizes, opts.matmuls),
                      start, axis=0)
        row = jnp.arange(T * k)
        ys = jnp.where(((row >= start) & (row < start + jnp.sum(local_sizes)))[:, None], ys, 0)
    return combine(ys[inverse], weights)
