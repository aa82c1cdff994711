"""AsyncEngine: the engine's instances stepped by their own threads, with asyncio streams per request; the
in-process EngineClient (engine/client.py).

`add_request` validates and queues the request at once (a bad request raises and nothing is queued; it
never waits for a step) and returns an async iterator of RequestOutput snapshots, one per generated token,
the last with `finished=True`. Snapshots are taken on the instance thread as each token lands, so a slow
consumer still sees every step. `abort` cancels a request and frees its pages at the holding instance's
next step boundary. When a step raises (a device-side failure), that instance rebuilds the pool the failed
program may have consumed (Instance.recover), the requests that held pages there get the error, and
serving goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, Callable

from ernie_jax.engine.client import ModelInfo, NoExpertBalancer
from ernie_jax.engine.engine import Engine
from ernie_jax.engine.stats import EngineStats
from ernie_jax.engine.request import Request, RequestError
from ernie_jax.engine.outputs import RequestOutput, completion, request_output
from ernie_jax.sampling import SamplingParams

log = logging.getLogger("ernie_jax.engine")


class EngineError(RuntimeError):
    """The engine raised while stepping; the requests in flight get this error, the engine keeps serving."""


class AsyncEngine:
    def __init__(self, engine: Engine, on_finish: Callable[[Request], None] | None = None):
        """on_finish: called with each request as it finishes (before its pages are freed), for metrics."""
        self.engine = engine
        engine.on_finish = on_finish
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, str | None]] = {}
        self._ids = itertools.count()
        self.failed: BaseException | None = None  # fail_all's error: the engine serves nothing more
        engine.start(self._notify, self._fail)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, **pd) -> AsyncIterator[RequestOutput]:
        """Validates and queues now (raises RequestError); the caller never waits for a step. pd: Engine's
        export_kv / prefilled (prefill/decode across servers)."""
        if self.failed is not None:
            raise EngineError(f"the engine serves nothing more: {self.failed}")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"async-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        if self._streams.setdefault(request_id, (loop, stream, prompt))[1] is not stream:
            raise RequestError(f"request id {request_id!r} is already in use")
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id, **pd)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise EngineError(f"the engine failed while serving {request_id}: {out!r}") from out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the pages
                self.abort(request_id)

    @property
    def alive(self) -> bool:
        return self.failed is None and self.engine.alive

    def fail_all(self, error: BaseException) -> None:
        """The engine cannot go on (an instance across processes lost one): every request in flight gets
        `error`, new ones are refused, and `alive` turns false."""
        self.failed = error
        for request_id in list(self._streams):
            target = self._streams.pop(request_id, None)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, error)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cached_prefix_pages(self, prompt_ids: list[int]) -> int:
        return self.engine.cached_prefix_pages(prompt_ids)

    def info(self) -> ModelInfo:
        e = self.engine
        return ModelInfo(e.max_model_len, e.cfg.vocab_size, e.config.summary())

    def rebalance_experts(self) -> dict:
        if self.engine.balancer is None:
            raise NoExpertBalancer("this engine has no redundant experts (eplb_config)")
        return self.engine.rebalance_experts()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _notify(self, req: Request) -> None:
        target = self._streams.get(req.request_id)
        if target is not None:
            loop, stream, prompt = target
            loop.call_soon_threadsafe(stream.put_nowait, request_output(req, prompt, [completion(req)], req.finished))
            if req.finished:
                self._streams.pop(req.request_id, None)

    def _fail(self, req: Request, error: BaseException) -> None:
        target = self._streams.pop(req.request_id, None)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, error)
