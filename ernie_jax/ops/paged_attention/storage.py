"""How a KV page pool stores its values: as they are, or (XLA:CPU) a bf16 pool as its uint16 bits.

XLA:CPU scatters and gathers bf16 arrays through f32 copies of the whole operand (a copy of the pool per
layer per step), integer arrays in place; the bits are the same bf16 numbers. `stored` and `loaded`
convert at the pool's boundary, decided by the pool's dtype, so every reader and writer agrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BF16_BITS = jnp.uint16


def pool_dtype(dtype, bf16_as_bits: bool):
    """The dtype a pool of `dtype` values is allocated with."""
    return BF16_BITS if bf16_as_bits and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else dtype


def stored(x: jax.Array, dtype) -> jax.Array:
    """Values x as a pool of `dtype` stores them."""
    if jnp.dtype(dtype) == jnp.dtype(BF16_BITS):
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(dtype)


def loaded(x: jax.Array) -> jax.Array:
    """Slots read from a pool, as values."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.dtype(BF16_BITS) else x
