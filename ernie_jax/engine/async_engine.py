"""AsyncEngine: the engine stepped by one background thread, with asyncio streams per request.

`add_request` validates at once (a bad request raises and nothing is queued) and returns an async
iterator of RequestOutput snapshots, one per generated token, the last with `finished=True`. Snapshots
are taken on the stepping thread as each token lands, so a slow consumer still sees every step. `abort`
cancels a request and frees its pages at the next step boundary. All engine state is touched only by the
stepping thread; other threads hand it work through a queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from ernie_jax.engine.engine import Engine
from ernie_jax.engine.request import Request
from ernie_jax.engine.outputs import RequestOutput, completion, request_output
from ernie_jax.sampling import SamplingParams

log = logging.getLogger("ernie_jax.engine")


class EngineError(RuntimeError):
    """The engine raised while stepping; the requests in flight get this error, the engine keeps serving."""


class AsyncEngine:
    def __init__(self, engine: Engine, on_finish: Callable[[Request], None] | None = None):
        """on_finish: called (on the stepping thread) with each request that finishes, for metrics."""
        self.engine = engine
        self.on_finish = on_finish
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, str | None]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()  # add_request's validation and id check vs the stepping thread
        self._thread = threading.Thread(target=self._loop, name="ernie-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        with self._lock:
            request_id = self.engine.add_request(prompt_ids, params, request_id)
            req = self.engine.requests[request_id]
            stream: asyncio.Queue = asyncio.Queue()
            self._streams[request_id] = (loop, stream, prompt)
        self._wake.set()
        return self._iterate(req, stream)

    async def _iterate(self, req: Request, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise EngineError(f"the engine failed while serving {req.request_id}: {out!r}") from out
                yield out
                if out.finished:
                    return
        finally:
            if not req.finished:  # the consumer went away (client disconnect): free the pages
                self.abort(req.request_id)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _notify(self, req: Request, error: BaseException | None = None) -> None:
        if req.finished and self.on_finish is not None:
            self.on_finish(req)
        target = self._streams.get(req.request_id)
        if target is not None:
            loop, stream, prompt = target
            out = error or request_output(req, prompt, [completion(req)], req.finished)
            loop.call_soon_threadsafe(stream.put_nowait, out)
            if req.finished:
                self._streams.pop(req.request_id, None)

    def _loop(self) -> None:
        while not self._stop:
            while not self._inbox.empty():
                kind, request_id = self._inbox.get()
                req = self.engine.requests.get(request_id)
                if kind == "abort" and req is not None:
                    self.engine.abort(request_id)
                    self._notify(req)
            try:
                with self._lock:
                    busy = self.engine.has_unfinished()
                    touched = self.engine.step() if busy else []
            except Exception as e:  # noqa: BLE001 -- fail the requests in flight, keep the engine serving
                log.exception("engine step failed; aborting the requests in flight")
                for req in list(self.engine.requests.values()):
                    self.engine.abort(req.request_id)
                    self._notify(req, e)
                continue
            for req in touched:
                self._notify(req)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
