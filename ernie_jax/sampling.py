"""Sampling parameters (vLLM's names and defaults) and the on-device token sampler.

The sampler is one jitted function over a batch of rows, each with its own temperature, top-p, top-k and
seed; a row's random stream depends only on (seed, step), so the same seed gives the same tokens whatever
else is in the batch. temperature = 0 is greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


class SamplingParamsError(ValueError):
    """A request parameter out of its range; the message names the parameter."""


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    max_tokens: int | None = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, why):
            raise SamplingParamsError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")
        if self.n != 1:
            bad("n", "only n=1 is supported by the offline API")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]


def _row_key(seed, step):
    return jax.random.fold_in(jax.random.key(seed), step)


@jax.jit
def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seeds: jax.Array,
           steps: jax.Array) -> jax.Array:
    """logits [B,V] f32; temperature, top_p [B] f32; top_k [B] int32; seeds [B] uint32; steps [B] int32.

    Returns token ids [B] int32.
    """
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits, sorted_ids = lax.top_k(logits / t, V)
    rank = jnp.arange(V)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # the top token is always kept
    keys = jax.vmap(_row_key)(seeds, steps)
    choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
