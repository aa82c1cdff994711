"""`EngineClient`: what a front end (the OpenAI server, a router next) needs of an engine, and nothing
more. The server depends on this protocol only, never on engine internals; `AsyncEngine`
(engine/async_engine.py) implements it over the in-process engine, and a remote engine or a router will
implement the same methods."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Protocol

from ernie_jax.engine.outputs import RequestOutput
from ernie_jax.engine.stats import EngineStats
from ernie_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What clients are told about the served model."""
    max_model_len: int
    vocab_size: int
    config: dict[str, Any]  # EngineConfig.summary()


class NoExpertBalancer(RuntimeError):
    """An EPLB action on an engine without redundant experts."""


class EngineClient(Protocol):
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (naming the field) for a request the engine cannot serve; queues nothing."""

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, **pd) -> AsyncIterator[RequestOutput]:
        """Validate and queue a request now; its outputs stream as they come, the last one finished.
        pd: export_kv / prefilled, for prefill and decode on different servers (Engine.add_request)."""

    def abort(self, request_id: str) -> None:
        """Finish a request as aborted and free what it holds (a no-op for an unknown or finished one)."""

    def stats(self) -> EngineStats:
        """An immutable snapshot of the engine's state and counters."""

    def info(self) -> ModelInfo: ...

    def cached_prefix_pages(self, prompt_ids: list[int]) -> int:
        """Leading full pages of this prompt the engine's prefix cache holds now (PD across servers: the
        prefill server need not send them)."""

    @property
    def alive(self) -> bool:
        """Whether the engine is serving (health)."""

    def rebalance_experts(self) -> dict:
        """EPLB: re-place the redundant experts from measured load; NoExpertBalancer when there are none."""

    def shutdown(self) -> None: ...
