"""Routed experts over the assignments sorted by expert, a tile of rows at a time (XLA:CPU prefill sizes).

One loop per local expert over ceil(load / tile) tiles, so the work follows the routed load with at most
one tile of padding per expert (the capacity form pads every expert to the largest load, then to a power
of two). A tile that runs past its expert's rows computes the next experts' first rows with the wrong
weights; the experts run in row order, so those rows' own expert overwrites them afterwards. Rows travel
as integer bits (common.bits says why). The loops have data-dependent trip counts: not differentiable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.ops.dense import swiglu
from ernie_jax.ops.routed_experts.common import (ExpertOptions, bits, combine, expert_groups, local_assignments,
                                                 num_local, ranks)


def tiled_experts(x, weights, ids, up_gate, down, num_experts: int, first_expert, batch_invariant: bool,
                  opts: ExpertOptions) -> jax.Array:
    T, k = ids.shape
    local, BT = num_local(up_gate), opts.tile_rows
    e, mine = local_assignments(ids, first_expert, local)
    key = jnp.where(mine, e, local)  # other devices' experts sort last
    rank, sizes = ranks(key, local + 1)
    starts = jnp.cumsum(sizes) - sizes
    row = starts[key] + rank  # [T*k]: each assignment's row in expert order (a counting sort)
    # The token of each row (T: a zero row, also for a tile running past the end).
    src = jnp.full((T * k + BT,), T, jnp.int32).at[row].set(jnp.arange(T * k, dtype=jnp.int32) // k)
    xb = bits(x)
    xs = jnp.concatenate([xb, jnp.zeros_like(xb[:1])]).at[src].get(mode="promise_in_bounds")  # [T*k+BT,H]

    def tile(j, ys, *, i, w_up, w_down):
        r = starts[i] + j * BT
        xt = lax.bitcast_convert_type(lax.dynamic_slice_in_dim(xs, r, BT), x.dtype)
        y = swiglu(xt, w_up, w_down, opts.matmuls)
        return lax.dynamic_update_slice_in_dim(ys, bits(y), r, 0)

    def one(w, i):  # expert i's matrix
        groups = expert_groups(w)
        n = groups[0].shape[0]
        return lax.bitcast_convert_type(bits(groups[i // n])[i % n], groups[0].dtype)
    ys = jnp.zeros_like(xs)
    for i in range(local):
        body = functools.partial(tile, i=i, w_up=one(up_gate, i), w_down=one(down, i))
        ys = lax.fori_loop(0, (sizes[i] + BT - 1) // BT, body, ys)
    ys = jnp.where(mine[:, None], lax.bitcast_convert_type(ys[row], x.dtype), 0)  # [T*k,H]
    return combine(ys, weights)
