"""The compile pool: ahead-of-time compiles run on a thread pool (XLA compiles without the GIL, so start-up
uses every core), or one at a time behind a serving engine (`compile_behind`), and can be cancelled by a
shutting-down engine."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

log = logging.getLogger("ernie_jax.engine")


def compile_all(jobs: dict[Any, Callable[[], Any]], on_done: Callable[[Any, Any, float], None],
                workers: int | None = None, cancelled: threading.Event | None = None) -> None:
    """Run compile jobs on a thread pool (XLA compiles without the GIL, so start-up uses every core) and
    hand each result to on_done(key, result, seconds) as it finishes. Jobs not started when `cancelled` is
    set are skipped: the interpreter joins pool threads at exit, so a shutdown would otherwise wait for
    every queued compile. Once `cancelled` is set no pool is made at all: at interpreter exit a new pool
    refuses work ("cannot schedule new futures after interpreter shutdown")."""
    if cancelled is not None and cancelled.is_set():
        return

    def timed(job):
        if cancelled is not None and cancelled.is_set():
            return None
        t0 = time.perf_counter()
        return job(), time.perf_counter() - t0
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        futures = {pool.submit(timed, job): key for key, job in jobs.items()}
        for f in concurrent.futures.as_completed(futures):
            if (done := f.result()) is not None:
                on_done(futures[f], *done)


def compile_behind(queues: list[list[tuple[Callable[[], Any], Callable[[Any, float], None]]]],
                   busy: Callable[[], bool], cancelled: threading.Event, max_pause: float = 10.0) -> int:
    """Compile programs one at a time behind a serving engine: `queues` holds (lower, on_done) pairs, one
    list per instance in its own order of use, taken in turn. Before each program the calling thread waits
    while busy() (requests are being served), for at most max_pause seconds so constant traffic still gets
    its programs, then lowers it (Python, holding the GIL: at normal priority, so a serving thread never
    waits for the GIL behind a starved thread; a program in the compiled-program store is loaded instead)
    and hands the XLA compile, which releases the GIL, to a worker thread at the lowest CPU priority. on_done(executable, seconds). Returns how many compiled."""
    done, t0 = 0, time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, initializer=_lowest_priority,
                                               thread_name_prefix="ernie-compile-xla") as worker:
        for pair in itertools.chain.from_iterable(itertools.zip_longest(*queues)):
            if pair is None:
                continue
            lower, on_done = pair
            deadline = time.monotonic() + max_pause
            while busy() and time.monotonic() < deadline and not cancelled.is_set():
                time.sleep(0.05)
            if cancelled.is_set():
                break
            started = time.perf_counter()
            try:
                result = worker.submit(lower().compile).result()
            except Exception:  # noqa: BLE001 -- that bucket stays out: its work runs padded in a larger one
                log.exception("a background compile failed; the engine keeps serving with the programs it has")
                continue
            on_done(result, time.perf_counter() - started)
            done += 1
    log.info("%d more programs compiled in the background in %.1f s%s", done, time.perf_counter() - t0,
             " (stopped: shutting down)" if cancelled.is_set() else "")
    return done


def _lowest_priority() -> None:
    """Nice 19 for the calling thread (Linux: a thread is a task with its own nice value; threads XLA starts
    from it inherit it). Elsewhere, or where not permitted, the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as e:
        log.debug("background compiles keep the normal priority: %s", e)
