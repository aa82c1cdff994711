"""Expert parallelism: the MoE block under `jax.shard_map`, dropless, with replicated tokens.

Each device holds E / n experts (n = the product of the mesh axes that "experts" maps to). Inside the
shard_map every device routes all tokens of its batch shard (the router is replicated), computes only the
assignments to its own experts (layers.routed_experts), and a psum over the expert axes adds the shares
up; when "experts" also spans the batch axis the tokens are all-gathered first and the sum is
psum-scattered back. No token is ever dropped and expert weights never move: only activations do.
This path needs no ragged all-to-all, so it runs on every backend (XLA:CPU has none, ANCHORS P4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ernie_jax.config import ErnieConfig
from ernie_jax.model.layers import route, routed_experts, shared_experts
from ernie_jax.sharding.rules import LEAF_AXES, ShardingError, ShardingPlan


def _linear_index(axes: tuple[str, ...], plan: ShardingPlan) -> jax.Array:
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * plan.size_of((a,)) + lax.axis_index(a)
    return idx


def moe_ep(x: jax.Array, w: dict, cfg: ErnieConfig, plan: ShardingPlan) -> tuple[jax.Array, jax.Array]:
    """x [B,T,H] (batch sharded per the rules) -> (y [B,T,H], expert ids [B*T,k])."""
    expert_axes = plan.axes_of("experts")
    batch_axes = tuple(a for a in plan.axes_of("batch") if plan.size_of((a,)) > 1)
    n = plan.size_of(expert_axes)
    if cfg.moe_num_experts % n:
        raise ShardingError(f"moe_num_experts={cfg.moe_num_experts} is not divisible by the {n} devices of mesh "
                            f"axes {expert_axes}")
    B = x.shape[0]
    if B % plan.size_of(batch_axes):
        raise ShardingError(f"batch {B} is not divisible by the data-parallel size {plan.size_of(batch_axes)}")
    gather = tuple(a for a in batch_axes if a in expert_axes)
    reduce = tuple(a for a in expert_axes if a not in gather)
    local = cfg.moe_num_experts // n
    bspec = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None

    def body(x, router, bias, up_gate, down):
        if gather:
            x = lax.all_gather(x, gather, axis=0, tiled=True)
        b, t, h = x.shape
        x2 = x.reshape(b * t, h)
        weights, ids = route(x2, router, bias, cfg)
        y = routed_experts(x2, weights, ids, up_gate, down, cfg.moe_num_experts,
                           _linear_index(expert_axes, plan) * local)
        y = y.reshape(b, t, h)
        ids = ids.reshape(b, t, -1)
        if reduce:
            y = lax.psum(y, reduce)
        if gather:
            y = lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
            ids = lax.dynamic_slice_in_dim(ids, _linear_index(gather, plan) * (b // plan.size_of(gather)),
                                           b // plan.size_of(gather), axis=0)
        return y, ids

    espec = lambda name, leaf: plan.spec(LEAF_AXES[name], tuple(leaf.shape), name)  # noqa: E731
    in_specs = (P(bspec, None, None), P(), P(), jax.tree.map(lambda a: espec("experts_up_gate", a), w["experts_up_gate"]),
                jax.tree.map(lambda a: espec("experts_down", a), w["experts_down"]))
    y, ids = jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=(P(bspec, None, None),
                                                                               P(bspec, None, None)),
                           check_vma=False)(x, w["router"], w["router_bias"], w["experts_up_gate"], w["experts_down"])
    x2 = x.reshape(-1, x.shape[-1])
    if "shared_up_gate" in w:  # outside the shard_map: sharded by the rules like any dense FFN
        y = y + shared_experts(x2, w, plan).reshape(y.shape)
    return y, ids.reshape(-1, ids.shape[-1])
