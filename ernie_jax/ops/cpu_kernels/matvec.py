"""The jax side of matvec.cc: matmuls with a few rows against bf16 weights (XLA:CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops.cpu_kernels import require


def expert_matvec(x: jax.Array, ids: jax.Array, groups: tuple[jax.Array, ...]) -> jax.Array:
    """y[r, j] = x[r] @ w[ids[r, j]] -> [R, J, N] f32, with x [R, K] (multiplied in f32: exact for bf16), ids
    [R, J] and the experts' weights as consecutive groups of [E_g, K, N] bf16 stacks, numbered across the
    groups in order. An id outside [0, sum E_g) gives a zero row."""
    require("matvec")
    if any(g.dtype != jnp.bfloat16 or g.ndim != 3 or g.shape[1:] != groups[0].shape[1:] for g in groups):
        raise ValueError(f"expert_matvec: weight groups must be bf16 [E_g, K, N] stacks of one [K, N], got "
                         f"{[(g.dtype.name, g.shape) for g in groups]}")
    if x.ndim != 2 or ids.ndim != 2 or x.shape[0] != ids.shape[0] or x.shape[1] != groups[0].shape[1]:
        raise ValueError(f"expert_matvec: x {x.shape} and ids {ids.shape} must be [R, K] and [R, J] with the "
                         f"weights' K = {groups[0].shape[1]}")
    out = jax.ShapeDtypeStruct((x.shape[0], ids.shape[1], groups[0].shape[2]), jnp.float32)
    return jax.ffi.ffi_call("ErnieJaxExpertMatvec", out)(x.astype(jnp.float32), ids.astype(jnp.int32), *groups)


def matvec_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """y = x @ w.T -> [R, N] f32, with x [R, K] (multiplied in f32) and w [N, K] bf16 (a tied LM head)."""
    require("matvec")
    if w.dtype != jnp.bfloat16 or w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matvec_t: x {x.shape} and w {w.dtype.name} {w.shape} must be [R, K] and bf16 [N, K]")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("ErnieJaxMatvecT", out)(x.astype(jnp.float32), w)
