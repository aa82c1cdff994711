"""Routed experts as one batched matmul over the local experts, each padded to a row capacity (XLA:CPU).

XLA:CPU runs this batched matmul straight from the expert weights' layout, and its cost follows the routed
load rather than T*E_local. The capacity is the smallest of `expert_capacities` that holds the step's
largest local expert load (a lax.switch over one branch per capacity), so every assignment gets a slot:
dropless, whatever the routing. batch_invariant: always the largest capacity, so a token's result never
depends on how the other tokens were routed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ernie_jax.ops.dense import swiglu
from ernie_jax.ops.routed_experts.common import (ExpertOptions, combine, expert_groups, local_assignments,
                                                 num_local, ranks)


def expert_capacities(tokens: int, k: int, num_experts: int, midpoints: bool = True) -> list[int]:
    """The per-expert row capacities a step picks from, ascending: powers of two from the mean load (and
    from 2: XLA:CPU runs one-row matmuls through a slow f32 fallback) up to `tokens`, with `midpoints` also
    1.5x each power of two from 8 (12, 24, 48, ...). A token picks an expert at most once, so no expert gets
    more than `tokens` rows and the last capacity always holds every assignment. Each capacity is a branch
    of the compiled program: finer steps pad less but compile slower. The largest load is usually well
    above the mean (a trained router is uneven), so a 16-token step mostly lands between 8 and 16 rows,
    where 12 saves a quarter of the work (benchmarks/RESULTS.md, "Routed-expert capacities on XLA:CPU")."""
    mean = max(-(-tokens * k // num_experts), 2)
    out, c = [], 1
    while c < tokens:
        if c >= mean:
            out.append(c)
        if midpoints and c >= 8 and c * 3 // 2 < tokens and c * 3 // 2 >= mean:
            out.append(c * 3 // 2)
        c *= 2
    return out + [tokens]


def _at_capacity(x, weights, ids, up_gate, down, first_expert, opts: ExpertOptions, *, capacity: int):
    T, k = ids.shape
    local, C = num_local(up_gate), capacity
    e, mine = local_assignments(ids, first_expert, local)
    rank, _ = ranks(e, local)  # the assignment's row within its expert (0 for other devices' experts)
    slot = jnp.where(mine, e * C + rank, local * C)  # other devices' experts go to a slot past the end
    # The token in each slot (T, a zero row, for empty ones): a gather of x's rows, where scattering them
    # would make XLA:CPU scatter in f32 and hand the matmul f32 rows (and so f32 copies of the weights).
    src = jnp.full((local * C + 1,), T, jnp.int32).at[slot].set(jnp.arange(T * k, dtype=jnp.int32) // k)
    xs = jnp.take(x, src[:-1].reshape(local, C), axis=0, mode="fill", fill_value=0)  # [E_local,C,H]
    groups = list(zip(expert_groups(up_gate), expert_groups(down)))
    n = groups[0][0].shape[0]  # a batched matmul per group of experts
    ffn = jax.vmap(functools.partial(swiglu, mm=opts.matmuls))
    ys = jnp.concatenate([ffn(xs[g * n:(g + 1) * n], u, d) for g, (u, d) in enumerate(groups)])
    ys = jnp.take(ys.reshape(local * C, -1), slot, axis=0, mode="fill", fill_value=0)  # [T*k,H], 0 if not local
    return combine(ys, weights)


def capacity_experts(x, weights, ids, up_gate, down, num_experts: int, first_expert, batch_invariant: bool,
                     opts: ExpertOptions) -> jax.Array:
    caps = expert_capacities(ids.shape[0], ids.shape[1], num_experts, opts.capacity_midpoints)
    caps = caps[-1:] if batch_invariant else caps
    run = [functools.partial(_at_capacity, opts=opts, capacity=c) for c in caps]
    if len(run) == 1:
        return run[0](x, weights, ids, up_gate, down, first_expert)
    local = num_local(up_gate)
    e, mine = local_assignments(ids, first_expert, local)
    load = jnp.bincount(jnp.where(mine, e, local), length=local)  # local experts only
    return lax.switch(jnp.sum(jnp.asarray(caps[:-1]) < jnp.max(load)), run, x, weights, ids, up_gate, down,
                      first_expert)
