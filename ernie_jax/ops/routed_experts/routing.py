"""The MoE router: an fp32 softmax whose correction bias picks the experts but does not weight them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def route(x: jax.Array, router: jax.Array, bias: jax.Array, k: int, norm_min: float
          ) -> tuple[jax.Array, jax.Array]:
    """x [T,H], router [H,E], bias [E] -> (weights [T,k] f32 renormalised, expert ids [T,k] int32)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    _, ids = lax.top_k(probs + bias.astype(jnp.float32), k)
    w = jnp.take_along_axis(probs, ids, axis=-1)
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), norm_min)
    return w, ids.astype(jnp.int32)


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Order the T*k (token, expert) assignments by expert.

    Returns (order [T*k]: assignment index at each sorted row, inverse [T*k], group_sizes [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, inverse, group_sizes


def to_slots(ids: jax.Array, slots: jax.Array, replicas: jax.Array) -> jax.Array:
    """Logical expert ids [T,k] -> the physical slot of one of each expert's replicas (redundant experts,
    sharding/eplb.py): slots [E,M] lists each expert's replica slots, replicas [E] how many it has. The
    replica is the assignment's index modulo that count, so the choice is deterministic and an expert's
    assignments spread evenly over its replicas."""
    T, k = ids.shape
    index = jnp.arange(T * k, dtype=jnp.int32).reshape(T, k)
    replica = index % jnp.take(replicas, ids)
    return jnp.take_along_axis(jnp.take(slots, ids, axis=0), replica[..., None], axis=-1)[..., 0]
