"""Grouped integer-weight matmul for MoE experts: rows of x [M, K] sorted by group, group g times IntWeight w[g].

group_sizes [G] say how many rows each group has; rows past their sum produce zeros (lax.ragged_dot's
contract). Implementations, preferred first: the Pallas-Triton kernel (pallas_triton.py), then the XLA
reference (quant.int_ragged_dot). Output f32, as the reference's.
"""

from __future__ import annotations

import jax.numpy as jnp

from ernie_jax.ops.base import Implementation, Op, Platform, interpret, kernel_platform, note_fallback
from ernie_jax.ops.grouped_int_matmul.pallas_triton import grouped_int_matmul_pallas
from ernie_jax.ops.int_weight_matmul import kernel_limit
from ernie_jax.quant import IntWeight, int_ragged_dot


def reference(x, w: IntWeight, group_sizes, platform: Platform | None = None):
    return int_ragged_dot(x, w, group_sizes)


def _pallas(x, w: IntWeight, group_sizes, platform: Platform | None = None):
    return grouped_int_matmul_pallas(x, w.values, w.scales, group_sizes, bits=w.bits, group=w.group, rows=w.rows,
                                     w4a8=w.compute == "w4a8",
                                     interpret=interpret(platform)).astype(jnp.float32)


OP = Op("grouped_int_matmul", (
    Implementation("pallas_triton", _pallas, kernel_platform(need_fp8_mma=False), kernel=True),
    Implementation("xla", reference),
))


def grouped_int_matmul(x, w: IntWeight, group_sizes, *, implementation: str = "xla",
                       platform: Platform | None = None):
    """x [M, K]; w an IntWeight [G, K, N]; group_sizes [G] -> [M, N] f32."""
    if OP.get(implementation).kernel and (why := kernel_limit(w)):
        note_fallback(OP.name, implementation, why)
        implementation = "xla"
    return OP.get(implementation).fn(x, w, group_sizes, platform)
