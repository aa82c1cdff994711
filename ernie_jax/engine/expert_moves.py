"""EPLB's device-side half: moving the routed experts of placed weights into a new placement's slots."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.sharding.eplb import slot_map


def move_experts(weights: dict, old, new, put: Callable) -> None:
    """Move the routed experts of `weights` (placed, in `old`'s slots) into `new`'s slots (sharding/eplb
    Placements), device to device, in place in the weights dict: each new slot takes its expert from the
    slot that expert had first, and the routing maps are replaced. Arrays keep their shapes and shardings,
    so compiled programs serve on unchanged; a step already dispatched keeps the arrays it was given.
    put(x): a host array onto the weights' mesh, replicated."""
    E = old.replicas.shape[1]
    first = np.argmax(old.slot_expert[:, None, :] == np.arange(E)[None, :, None], axis=-1)  # [L, E]
    src = np.take_along_axis(first, new.slot_expert, axis=1).astype(np.int32)  # [L, S]
    slots, replicas = slot_map(new)

    def take(a, idx, axis):
        move = jax.jit(functools.partial(jnp.take, axis=axis), out_shardings=a.sharding)
        return move(a, put(idx))

    def moved(layer: dict, rows: slice, axis: int) -> dict:
        out = dict(layer)
        for name in ("experts_up_gate", "experts_down"):
            out[name] = jax.tree.map(lambda a: take(a, src[rows] if axis else src[rows.start], axis), layer[name])
        for name, new_map in (("expert_slots", slots), ("expert_replicas", replicas)):
            out[name] = jax.device_put(new_map[rows] if axis else new_map[rows.start], layer[name].sharding)
        return out
    row = 0
    for s, seg in enumerate(weights["segments"]):
        layers = seg if isinstance(seg, list) else None
        if "expert_slots" not in (layers[0] if layers else seg):
            continue
        L = len(layers) if layers else seg["expert_slots"].shape[0]
        if layers:  # weights.cpu_layout: one pytree per layer, experts [S, ...]
            weights["segments"][s] = [moved(w, slice(row + i, row + i + 1), 0) for i, w in enumerate(layers)]
        else:  # stacked [L, S, ...]
            weights["segments"][s] = moved(seg, slice(row, row + L), 1)
        row += L
