"""What the routed-expert implementations share: expert groups, assignment bookkeeping, the combine.

An expert leaf is a stacked [E_local, ...] array (or BlockFP8), or a tuple of such stacks of consecutive
experts (model.weights.cpu_layout). `first_expert` is the global index of the leaf's first expert: under
expert parallelism a device holds E_local of the E experts and computes only their assignments.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.ops.dense import Matmuls


class ExpertOptions(NamedTuple):
    """Per-call settings of the routed-expert implementations (ExecutionConfig.expert_options)."""
    matmuls: Matmuls = Matmuls()
    tile_rows: int = 256  # rows per tile of the tiled form (and its prefill threshold in xla_cpu)
    sorted_tile_rows: int = 128  # rows per tile of the sorted-tiles form
    capacity_midpoints: bool = True  # the capacity form's capacities: powers of two and, from 8, 1.5x between
    matvec_max_tokens: int = 2048  # the most tokens cpu_matvec gives its kernel (more: the xla_cpu forms)


def expert_groups(w) -> tuple:
    return w if isinstance(w, tuple) else (w,)


def num_local(w) -> int:
    return sum(g.shape[0] for g in expert_groups(w))


def local_assignments(ids: jax.Array, first_expert, local: int) -> tuple[jax.Array, jax.Array]:
    """ids [T,k] -> (the local expert index of each assignment [T*k], whether that expert is local)."""
    e = ids.reshape(-1) - first_expert
    return e, (e >= 0) & (e < local)


def ranks(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """key [M] -> (each entry's rank among the entries of its key [M], the count of each key in [0, n) [n]).
    Keys outside [0, n) get rank 0 and are not counted."""
    hot = (key[:, None] == jnp.arange(n)).astype(jnp.int32)  # [M,n]
    return jnp.sum((jnp.cumsum(hot, axis=0) - 1) * hot, axis=-1), jnp.sum(hot, axis=0)


def combine(ys: jax.Array, weights: jax.Array) -> jax.Array:
    """Each token's routed output: its k assignments' rows ys [T*k,H] weighted by weights [T,k]."""
    T, k = weights.shape
    return jnp.einsum("tkh,tk->th", ys.reshape(T, k, -1), weights.astype(ys.dtype),
                      preferred_element_type=jnp.float32).astype(ys.dtype)


def bits(x: jax.Array) -> jax.Array:
    """x viewed as unsigned integers of its width. XLA:CPU gathers, slices and updates bf16 arrays through f32
    copies of the whole operand (hoisted out of loops: a copy of every expert's weights per layer), and
    integer arrays in place."""
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
