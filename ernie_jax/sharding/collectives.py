"""Collectives that not every backend has, behind one call each.

`ragged_all_to_all` is `jax.lax.ragged_all_to_all` on GPU and TPU. XLA:CPU cannot compile that op
(docs/xla-notes.md N2, jax#34755), so on CPU the same semantics are built from an all-gather and masked scatters:
slower and O(n) in memory, but exact, which lets the all-to-all expert-parallel path be tested on fake CPU
devices. `lax.platform_dependent` picks the branch when the program is lowered, so a program lowered for
CUDA on this machine contains the real ragged all-to-all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (same arguments): device i sends operand[input_offsets[j]:+send_sizes[j]]
    to device j, where it lands at output[output_offsets[j] on i's side:]; recv_sizes[i] rows come from i.
    Inside shard_map; axis_name may be a tuple of mesh axes (devices ordered row-major over them)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return lax.platform_dependent(
        *args, cpu=lambda *a: _gathered_ragged_all_to_all(*a, axis_name=axis_name),
        default=lambda *a: lax.ragged_all_to_all(*a, axis_name=axis_name))


def axis_linear_index(axis_name) -> jax.Array:
    """This device's index over the (tuple of) mesh axes, row-major, as all_gather orders them."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    idx = jnp.int32(0)
    for a in names:
        idx = idx * lax.axis_size(a) + lax.axis_index(a)
    return idx


def _gathered_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    del recv_sizes  # implied by the senders' send_sizes
    ops = lax.all_gather(operand, axis_name, axis=0)  # [n, M, ...]
    offs_in, sizes, offs_out = (lax.all_gather(a, axis_name, axis=0) for a in (input_offsets, send_sizes,
                                                                               output_offsets))  # [n, n]
    me = axis_linear_index(axis_name)
    rows = jnp.arange(operand.shape[0])
    for i in range(ops.shape[0]):
        src = jnp.clip(offs_in[i, me] + rows, 0, operand.shape[0] - 1)
        dst = jnp.where(rows < sizes[i, me], offs_out[i, me] + rows, output.shape[0])  # past the end: dropped
        output = output.at[dst].set(ops[i][src], mode="drop")
    # Rows past the end of `output` are an error in the real collective: make them loud here (NaN) so a
    # wrong receive capacity cannot pass a test silently.
    overflow = jnp.any(offs_out[:, me] + sizes[:, me] > output.shape[0])
    return jnp.where(overflow, jnp.nan, output) if jnp.issubdtype(output.dtype, jnp.floating) else output
