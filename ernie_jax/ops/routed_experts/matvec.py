"""Routed experts at decode sizes through the expert_matvec CPU kernel (ops/cpu_kernels/matvec): bf16 only.

Each assignment's row is multiplied by its own expert's weights, read once per step for all the rows that
chose it; experts no token chose are not read. Numerics are the capacity form's (bf16 products summed in
f32, rounded to the activation dtype after each matmul, silu_mul between), with only the order of the sums
inside a matmul differing; a row's result never depends on the other rows, so it is batch invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops.cpu_kernels.matvec import expert_matvec
from ernie_jax.ops.dense import silu_mul
from ernie_jax.ops.routed_experts.common import combine, expert_groups


def takes(ids, up_gate, down, max_tokens: int) -> bool:
    """Whether this call's experts are plain bf16 stacks and it has at most `max_tokens` tokens (past that,
    XLA:CPU's tiled and capacity forms run proper matrix-matrix products)."""
    leaves = expert_groups(up_gate) + expert_groups(down)
    return ids.shape[0] <= max_tokens and all(isinstance(w, jax.Array) and w.dtype == jnp.bfloat16 for w in leaves)


def matvec_experts(x, weights, ids, up_gate, down, first_expert) -> jax.Array:
    T, k = ids.shape
    local = ids.astype(jnp.int32) - first_expert  # another device's expert falls outside the groups: a zero row
    u = expert_matvec(x, local, expert_groups(up_gate)).astype(x.dtype)  # [T,k,2F]
    h = silu_mul(*jnp.split(u.reshape(T * k, -1), 2, axis=-1))  # [T*k,F]
    ys = expert_matvec(h, local.reshape(T * k, 1), expert_groups(down))[:, 0].astype(x.dtype)  # [T*k,H]
    return combine(ys, weights)
