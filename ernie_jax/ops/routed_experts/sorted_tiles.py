"""Routed experts as one batched matmul over row tiles, each tile multiplied by its own expert's weights.

The assignments are sorted by expert and each expert's rows padded to whole tiles (gathering the tile's
expert weights per tile): static shapes whatever the routing, at most one tile of padding per expert (the
capacity form pads every expert to the largest load), and differentiable, so it is the form training takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ernie_jax.ops.dense import silu_mul
from ernie_jax.ops.routed_experts.common import ExpertOptions, combine, local_assignments, num_local


def sorted_tile_experts(x, weights, ids, up_gate, down, num_experts: int, first_expert, batch_invariant: bool,
                        opts: ExpertOptions) -> jax.Array:
    T, k = ids.shape
    local, BT = num_local(up_gate), opts.sorted_tile_rows
    up_gate, down = (jnp.concatenate(w) if isinstance(w, tuple) else w for w in (up_gate, down))
    e, mine = local_assignments(ids, first_expert, local)
    key = jnp.where(mine, e, local)  # other devices' experts sort last and are not computed
    sizes = jnp.bincount(key, length=local + 1)[:local]
    padded = (sizes + BT - 1) // BT * BT
    ends = jnp.cumsum(padded)
    order = jnp.argsort(key, stable=True)  # assignment index at each sorted position
    sorted_key = key[order]
    rank = jnp.arange(T * k) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(sorted_key, local - 1)]
    tiles = T * k // BT + local  # enough for any routing: sum(ceil(size / BT)) <= T*k/BT + E_local
    row = jnp.where(sorted_key < local, (ends - padded)[jnp.minimum(sorted_key, local - 1)] + rank, tiles * BT)
    src = jnp.full((tiles * BT + 1,), T, jnp.int32).at[row].set((order // k).astype(jnp.int32))[:-1]
    xs = jnp.take(x, src, axis=0, mode="fill", fill_value=0).reshape(tiles, BT, -1)
    tile_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(tiles) * BT, side="right"), local - 1)
    u = jnp.einsum("nrh,nhf->nrf", xs, up_gate[tile_expert].astype(x.dtype), preferred_element_type=jnp.float32)
    a = silu_mul(*jnp.split(u.astype(x.dtype), 2, axis=-1))
    ys = jnp.einsum("nrf,nfh->nrh", a, down[tile_expert].astype(x.dtype), preferred_element_type=jnp.float32)
    ys = ys.astype(x.dtype).reshape(tiles * BT, -1)
    at = jnp.zeros((T * k,), jnp.int32).at[order].set(row.astype(jnp.int32))  # each assignment's row
    ys = jnp.take(ys, at, axis=0, mode="fill", fill_value=0)  # other devices' experts read past the end: 0
    return combine(ys, weights)
