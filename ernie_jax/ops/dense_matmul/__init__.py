"""Plain (unquantized) matmuls: x [..., K] @ w [K, N], or @ w.T for w [N, K] (a tied LM head reads the
embedding), multiplied in x's dtype with f32 accumulation -> [..., N] f32.

Implementations, preferred first: "cpu_matvec" (ops/cpu_kernels/matvec: a call with at most `max_rows` rows
against a bf16 weight, the shape of a decode step with a few sequences, else as "xla"; XLA:CPU where the
kernel builds), "xla" (an einsum: the reference).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ernie_jax.ops import cpu_kernels
from ernie_jax.ops.base import Implementation, Op


def xla_matmul(x: jax.Array, w: jax.Array, transposed: bool, max_rows: int) -> jax.Array:
    spec = "...i,oi->...o" if transposed else "...i,io->...o"
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def cpu_matvec_matmul(x: jax.Array, w: jax.Array, transposed: bool, max_rows: int) -> jax.Array:
    from ernie_jax.ops.cpu_kernels.matvec import expert_matvec, matvec_t
    rows = math.prod(x.shape[:-1])
    if not (isinstance(w, jax.Array) and w.dtype == jnp.bfloat16 and w.ndim == 2 and 0 < rows <= max_rows):
        return xla_matmul(x, w, transposed, max_rows)
    x2 = x.reshape(rows, x.shape[-1])
    if transposed:
        y = matvec_t(x2, w)
    else:  # one expert that every row chose
        y = expert_matvec(x2, jnp.zeros((rows, 1), jnp.int32), (w[None],))[:, 0]
    return y.reshape(*x.shape[:-1], y.shape[-1])


OP = Op("dense_matmul", (
    Implementation("cpu_matvec", cpu_matvec_matmul, cpu_kernels.supports("matvec"), library="matvec"),
    Implementation("xla", xla_matmul),
))


def dense_matmul(x: jax.Array, w: jax.Array, transposed: bool = False, *, implementation: str = "xla",
                 max_rows: int = 4) -> jax.Array:
    return OP.get(implementation).fn(x, w, transposed, max_rows)
