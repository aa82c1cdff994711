"""Expert parallelism: the MoE block under `jax.shard_map`, dropless; expert weights never move.

Each device holds E / n experts (n = the product of the mesh axes that "experts" maps to). Inside the
shard_map every device routes all tokens of its batch shard (the router is replicated; when "experts" also
spans the batch axis the tokens are all-gathered first and the result psum-scattered back). Then one of
two dispatches (the execution config's ep_dispatch):
- "replicated": each device computes the assignments to its own experts for every token
  (ops.routed_experts) and a psum over the expert axes adds the shares up. Needs no all-to-all; the
  default on CPU, where it is also the cheaper one.
- "all_to_all": each device takes 1/n of the tokens, sends each assignment's row to the device that owns
  its expert with a ragged all-to-all, runs the grouped matmul on what it received, sends the results back
  the same way and all-gathers the combined rows. The default on GPU and TPU: a device computes only
  routed rows and the traffic follows the routing. The receive buffer holds the worst case (every token's
  assignments to this device's experts), so nothing is dropped whatever the load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ernie_jax.config import ErnieConfig
from ernie_jax.ops.execution import ExecutionConfig
from ernie_jax.ops.routed_experts import grouped_swiglu, route, routed_experts, to_slots
from ernie_jax.sharding.collectives import axis_linear_index, ragged_all_to_all
from ernie_jax.sharding.rules import ShardingError, ShardingPlan


def routed_moe(x: jax.Array, w: dict, cfg: ErnieConfig, plan: ShardingPlan | None, ex: ExecutionConfig,
               batch_invariant: bool = False, shared: jax.Array | None = None, valid: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """The routed experts of x [B,T,H] plus `shared` ([B*T,H], the shared experts' output, or None) as the
    experts are placed: on one device (plan None) every expert runs locally, skipping the rows that `valid`
    ([B*T] bool, or None) marks as padding; under a mesh expert-parallel (moe_ep), every row.
    -> (y [B,T,H] or [B*T,H], expert ids [B*T,k])."""
    if plan is not None:
        return moe_ep(x, w, cfg, plan, ex, batch_invariant, shared)
    x2 = x.reshape(-1, x.shape[-1])
    with jax.named_scope("router"):
        weights, ids = route(x2, w["router"], w["router_bias"], cfg.moe_k, cfg.moe_norm_min)
    slots, num_slots = expert_slots(ids, w, cfg)
    y = routed_experts(x2, weights, slots, w["experts_up_gate"], w["experts_down"], num_slots,
                       batch_invariant=batch_invariant, implementation=ex.routed_experts, opts=ex.expert_options,
                       valid=valid)
    return (y if shared is None else y + shared), ids


def expert_slots(ids: jax.Array, w: dict, cfg: ErnieConfig) -> tuple[jax.Array, int]:
    """The physical expert slots the routed assignments ids [T,k] go to, and how many slots there are: the
    experts themselves, or with redundant experts (EPLB, sharding/eplb.py) one replica of each."""
    if "expert_slots" not in w:
        return ids, cfg.moe_num_experts
    E, M = w["expert_slots"].shape  # M = 1 + R
    return to_slots(ids, w["expert_slots"], w["expert_replicas"]), E + M - 1

def _my_rows(a: jax.Array, axes: tuple[str, ...], plan: ShardingPlan) -> jax.Array:
    """This device's block of the leading axis of a, split over `axes` (the inverse of a tiled all_gather)."""
    rows = a.shape[0] // plan.size_of(axes)
    return lax.dynamic_slice_in_dim(a, axis_linear_index(axes) * rows, rows, axis=0)


def moe_ep(x: jax.Array, w: dict, cfg: ErnieConfig, plan: ShardingPlan, ex: ExecutionConfig,
           batch_invariant: bool = False, shared: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The routed experts of x [B,T,H] (batch sharded per the rules), plus `shared` [B,T,H] (the shared
    experts' output, or None) -> (y [B,T,H], expert ids [B*T,k]). ex: the dispatch, and the local experts'
    implementation.
    With the replicated dispatch, each device adds shared / n to its share before the psum over the n
    expert devices, so one all-reduce sums both. Besides saving one, this orders the shared experts'
    collectives before the routed psum: independent, XLA:CPU may run them side by side, and each waiting
    participant holds a thread of one shared pool, which deadlocked the 4-device CPU prefill."""
    expert_axes = plan.axes_of("experts")
    batch_axes = tuple(a for a in plan.axes_of("batch") if plan.size_of((a,)) > 1)
    n = plan.size_of(expert_axes)
    redundant = "expert_slots" in w  # EPLB: E + R physical slots and the map to them (sharding/eplb.py)
    num_slots = cfg.moe_num_experts + (w["expert_slots"].shape[1] - 1 if redundant else 0)
    if num_slots % n:
        raise ShardingError(f"{num_slots} expert slots (moe_num_experts={cfg.moe_num_experts} and the redundant "
                            f"ones) are not divisible by the {n} devices of mesh axes {expert_axes}")
    B = x.shape[0]
    if B % plan.size_of(batch_axes):
        raise ShardingError(f"batch {B} is not divisible by the data-parallel size {plan.size_of(batch_axes)}")
    gather = tuple(a for a in batch_axes if a in expert_axes)
    reduce = tuple(a for a in expert_axes if a not in gather)
    local = num_slots // n
    a2a = ex.ep_dispatch == "all_to_all" and n > 1
    bspec = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None

    fold = shared is not None and not a2a and bool(reduce) and not gather

    def body(x, router, bias, up_gate, down, shared, slot_map):
        if gather:
            x = lax.all_gather(x, gather, axis=0, tiled=True)
        b, t, h = x.shape
        x2 = x.reshape(b * t, h)
        with jax.named_scope("router"):
            weights, ids = route(x2, router, bias, cfg.moe_k, cfg.moe_norm_min)
        slots = to_slots(ids, *slot_map) if redundant else ids
        if a2a:
            y = _all_to_all_experts(x2, weights, slots, up_gate, down, expert_axes, n, ex)
        else:
            y = routed_experts(x2, weights, slots, up_gate, down, num_slots,
                               axis_linear_index(expert_axes) * local, batch_invariant,
                               implementation=ex.routed_experts, opts=ex.expert_options)
        y = y.reshape(b, t, h)
        ids = ids.reshape(b, t, -1)
        if not a2a and reduce:  # a2a: y is already the whole sum, the same on every device
            if fold:
                y = y + (shared / plan.size_of(reduce)).astype(y.dtype)
            y = lax.psum(y, reduce)
        if gather:
            y = _my_rows(y, gather, plan) if a2a else lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
            ids = _my_rows(ids, gather, plan)
        return y, ids

    up_gate, down = w["experts_up_gate"], w["experts_down"]
    slot_map = (w["expert_slots"], w["expert_replicas"]) if redundant else ()
    in_specs = (P(bspec, None, None), P(), P(), plan.param_spec("experts_up_gate", up_gate),
                plan.param_spec("experts_down", down), P(bspec, None, None) if fold else P(),
                tuple(P() for _ in slot_map))
    y, ids = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=(P(bspec, None, None),
                                                                               P(bspec, None, None)),
                           check_vma=False)(x, w["router"], w["router_bias"], up_gate, down,
                                            shared.reshape(x.shape) if fold else jnp.zeros((), x.dtype), slot_map)
    if shared is not None and not fold:
        y = y + shared.reshape(y.shape).astype(y.dtype)
    return y, ids.reshape(-1, ids.shape[-1])


def _all_to_all_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, up_gate, down, axes: tuple[str, ...],
                        n: int, ex: ExecutionConfig) -> jax.Array:
    """The routed-expert output for x [T,H] (the same T tokens on each of the n devices of `axes`), computed
    by the devices that own the experts: each device dispatches T/n tokens' assignments and returns its
    share of the rows, all-gathered into [T,H]. weights, ids [T,k]; up_gate/down hold E_local experts."""
    T, H = x.shape
    k = ids.shape[1]
    local = up_gate.shape[0]
    t = -(-T // n)  # tokens per device; padding tokens fill T up to n*t with zero weights and, like real
    pad = n * t - T  # tokens, k distinct experts (so the receive-capacity bound below holds for them too)
    x, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights))
    ids = jnp.concatenate([ids, jnp.broadcast_to(jnp.arange(k, dtype=ids.dtype), (pad, k))])
    me = axis_linear_index(axes)
    x, weights, ids = (lax.dynamic_slice_in_dim(a, me * t, t) for a in (x, weights, ids))
    # Send side: my assignments sorted by expert, hence by owning device.
    flat = ids.reshape(-1)  # [t*k]
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    counts = jnp.bincount(flat, length=n * local).reshape(n, local).astype(jnp.int32)  # [dst, local expert]
    send = jnp.sum(counts, axis=1)
    send_offsets = jnp.cumsum(send) - send
    every = lax.all_gather(counts, axes, axis=0)  # [src, dst, local expert]: all devices' counts, tiny
    sizes = jnp.sum(every, axis=2)  # [src, dst]
    slot_in_dst = jnp.cumsum(sizes, axis=0) - sizes  # where src's rows start in dst's receive buffer
    recv = sizes[:, me]
    recv_offsets = slot_in_dst[:, me]
    capacity = n * t * min(k, local)  # worst case: every token sends min(k, E_local) rows here
    got = ragged_all_to_all(rows, jnp.zeros((capacity, H), x.dtype), send_offsets, send, slot_in_dst[me], recv,
                            axis_name=axes)
    # Receive side: rows arrive by source, each source's sorted by my local expert; regroup by expert.
    mine = every[:, me, :]  # [src, local expert]
    ends = jnp.cumsum(mine.reshape(-1))
    row = jnp.arange(capacity)
    expert = jnp.where(row < ends[-1], jnp.searchsorted(ends, row, side="right") % local, local)
    by_expert = jnp.argsort(expert, stable=True)
    ys = grouped_swiglu(got[by_expert], up_gate, down, jnp.sum(mine, axis=0), ex.matmuls)
    ys = jnp.zeros_like(ys).at[by_expert].set(ys)  # back to arrival order
    # Results return to their senders at the offsets the rows left from.
    back = ragged_all_to_all(ys, jnp.zeros((t * k, H), x.dtype), recv_offsets, recv, _offsets_at_sources(sizes, me),
                             send, axis_name=axes)
    y = jnp.zeros_like(back).at[order].set(back).reshape(t, k, H)
    y = jnp.einsum("tkh,tk->th", y, weights.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return lax.all_gather(y, axes, axis=0, tiled=True)[:T]


def _offsets_at_sources(sizes: jax.Array, me: jax.Array) -> jax.Array:
    """For each source device i, where its rows for device `me` started in i's send buffer. sizes [src, dst]."""
    return (jnp.cumsum(sizes, axis=1) - sizes)[:, me]
