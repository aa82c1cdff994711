"""Time from `python -m ernie_jax.serve ...` to the first answered chat request, cold and warm.

    python benchmarks/serve_startup.py [--runs cold,warm] [-- SERVER FLAGS...]

"cold" uses an empty persistent compilation cache (every program compiles), "warm" the cache the cold run
filled. Each run launches the server, polls POST /v1/chat/completions until it answers, prints the
seconds, and stops the server with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_first_answer(flags: list[str], cache: str, timeout: float = 600) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ernie_jax.serve", "--port", str(port),
                             "--compilation-cache-dir", cache, *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = {"messages": [{"role": "user", "content": "你好"}], "max_tokens": 8}
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
                if r.status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"no answer within {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("flags", nargs="*", help="server flags (after --), e.g. -- --mesh 8")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="ernie_jax_startup_cache_")
    for run in args.runs.split(","):
        seconds = time_to_first_answer(args.flags, cache)
        print(f"{run}: first chat answer {seconds:.1f} s after launch ({' '.join(args.flags) or 'default flags'})",
              flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
