"""The dense linear and the SwiGLU FFN: where a weight's matmul numerics are chosen.

A plain weight multiplies in the activation dtype with f32 accumulation; a block-FP8 weight (quant.BlockFP8)
runs its own compute mode: "w8a8" through the block_fp8_matmul op (the implementation the execution config
chose), "weight_only" through quant.fp8_linear; an integer weight (quant.IntWeight: wint8, wint4, w4a8) through
the int_weight_matmul op; a plain one through the dense_matmul op. Weights are in the Paddle [in, out]
orientation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ernie_jax.ops.base import Platform
from ernie_jax.ops.block_fp8_matmul import block_fp8_matmul
from ernie_jax.ops.dense_matmul import dense_matmul
from ernie_jax.ops.int_weight_matmul import int_weight_matmul
from ernie_jax.quant import BlockFP8, IntWeight, fp8_linear, int_linear


class Matmuls(NamedTuple):
    """The implementations of the matmul ops a computation calls (ExecutionConfig.matmuls)."""
    block_fp8: str = "xla"
    grouped_fp8: str = "xla"
    platform: Platform | None = None
    int_weight: str = "xla"
    grouped_int: str = "xla"
    dense: str = "xla"
    matvec_max_rows: int = 4  # the most rows dense="cpu_matvec" gives its kernel


def linear(x: jax.Array, w, mm: Matmuls = Matmuls()) -> jax.Array:
    """y = x @ w -> x's dtype."""
    if isinstance(w, BlockFP8):
        if w.compute == "w8a8" and w.values.ndim == 2:
            y = block_fp8_matmul(x.reshape(-1, x.shape[-1]), w.values, w.scales, w.k_major,
                                 implementation=mm.block_fp8, platform=mm.platform, block=w.block)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return fp8_linear(x, w)
    if isinstance(w, IntWeight):
        if w.values.ndim == 2:
            y = int_weight_matmul(x.reshape(-1, x.shape[-1]), w, implementation=mm.int_weight, platform=mm.platform)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return int_linear(x, w)
    return dense_matmul(x, w, implementation=mm.dense, max_rows=mm.matvec_max_rows).astype(x.dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, rounded as the reference kernels round: silu in fp32 rounded once to the activation
    dtype, then the product rounded once. (A bf16 `jax.nn.silu` would round after each of its elementwise
    ops, and XLA:CPU emulates each of those roundings, which made this the costliest elementwise op of a
    prefill.)"""
    s = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (s.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)


def swiglu(x: jax.Array, up_gate, down, mm: Matmuls = Matmuls()) -> jax.Array:
    """Paddle's fused `up_gate_proj` holds [gate | up] despite its name."""
    u = linear(x, up_gate, mm)
    return linear(silu_mul(*jnp.split(u, 2, axis=-1)), down, mm)
