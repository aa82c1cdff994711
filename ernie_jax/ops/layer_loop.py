"""The loop over a segment's decoder layers, in whichever layout its weights are in.

Stacked weights ([L, ...] leaves) run as one `lax.scan`, so compile time does not grow with depth. The
per-layer list that XLA:CPU runs (model/weights.cpu_layout: a scan there copies each layer's weights out
of the stack on every step) runs as one nested jit called per layer: every layer has the same signature,
the layer index passed as data, so the layer is traced once, as under scan, and XLA inlines each call.
The model calls `run_layers` and never asks which layout it has.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax


def run_layers(layer: Callable, carry: Any, weights: Any, count: int, *consts) -> tuple[Any, Any]:
    """carry -> layer(carry, w, index, *consts) -> (carry, out) over the `count` layers of `weights`;
    returns (the last carry, the outs stacked over layers, or None when the layer returns None)."""
    if isinstance(weights, list):
        step = jax.jit(layer)
        outs = []
        for i, w in enumerate(weights):
            carry, out = step(carry, w, jnp.int32(i), *consts)
            outs.append(out)
        return carry, None if outs[0] is None else jnp.stack(outs)

    def body(carry, xs):
        w, i = xs
        return layer(carry, w, i, *consts)
    return lax.scan(body, carry, (weights, jnp.arange(count)))
