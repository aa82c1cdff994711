"""The serving engine: paged KV pools, compiled prefill/decode programs, continuous batching."""

from ernie_jax.engine.engine import Engine, Request, RequestError

__all__ = ["Engine", "Request", "RequestError"]
