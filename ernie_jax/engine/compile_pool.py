"""The compile pool: ahead-of-time compiles run on a thread pool (XLA compiles without the GIL, so start-up
uses every core) and can be cancelled by a shutting-down engine."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Callable


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

