"""AsyncEngine: the engine stepped by one background thread, with asyncio streams per request.

`add_request` validates at once (a bad request raises and nothing is queued), hands the request to the
stepping thread through a queue (it never waits for a step: the thread adds it between two steps) and
returns an async iterator of RequestOutput snapshots, one per generated token, the last with
`finished=True`. Snapshots are taken on the stepping thread as each token lands, so a slow consumer still
sees every step. `abort` cancels a request and frees its pages at the next step boundary. All engine state
is touched only by the stepping thread. When a step raises (a device-side failure), the engine rebuilds the
pools the failed program may have consumed (Engine.recover), the requests that held pages get the error,
and serving goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from ernie_jax.engine.engine import Engine
from ernie_jax.engine.request import Request, RequestError
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
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ernie-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validates now (raises RequestError) and queues the request for the stepping thread, which adds it
        between two steps: the caller never waits for a step."""
        loop = asyncio.get_running_loop()
        prompt_ids = [int(t) for t in prompt_ids]
        self.engine.validate(prompt_ids, params)  # reads only the config and pool sizes
        request_id = request_id or f"async-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        if self._streams.setdefault(request_id, (loop, stream, prompt))[1] is not stream \
                or request_id in self.engine.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self._inbox.put(("add", request_id, (prompt_ids, params)))
        self._wake.set()
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
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
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

    def _fail(self, request_id: str, error: BaseException) -> None:
        target = self._streams.pop(request_id, None)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, error)

    def _take_inbox(self) -> None:
        while not self._inbox.empty():
            kind, request_id, args = self._inbox.get()
            if kind == "add":
                if request_id not in self._streams:
                    continue  # aborted before it was added
                try:
                    self.engine.add_request(*args, request_id=request_id)
                except Exception as e:  # noqa: BLE001 -- e.g. a pool check that changed since validation
                    self._fail(request_id, e)
            elif (req := self.engine.requests.get(request_id)) is not None:
                self.engine.abort(request_id)
                self._notify(req)
            else:  # not added yet, or finished: nothing to free
                self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stop:
            self._take_inbox()
            try:
                busy = self.engine.has_unfinished()
                touched = self.engine.step() if busy else []
            except Exception as e:  # noqa: BLE001 -- fail the requests in flight, keep the engine serving
                log.exception("engine step failed; rebuilding the KV pools and failing the requests that held pages")
                for req in self.engine.recover():
                    self._notify(req, e)
                continue
            for req in touched:
                self._notify(req)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
