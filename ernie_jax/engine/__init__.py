"""The serving engine: paged KV pools, compiled prefill/decode programs, scheduling, continuous batching."""

from ernie_jax.engine.engine import Engine
from ernie_jax.engine.request import Request, RequestError

__all__ = ["Engine", "Request", "RequestError"]
