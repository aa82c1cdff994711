"""A one-line progress bar with bytes/s for the converters (stderr, no dependencies)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_bytes: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = max(total_bytes, 1), label, stream
        self.done, self.t0, self.last = 0, time.perf_counter(), 0.0

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self.last >= 0.2 or self.done >= self.total:
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "=" * int(30 * frac)
            rate = self.done / max(now - self.t0, 1e-9)
            self.stream.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {self.done / 1e9:.2f}/"
                              f"{self.total / 1e9:.2f} GB {rate / 1e6:.0f} MB/s")
            self.stream.flush()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
