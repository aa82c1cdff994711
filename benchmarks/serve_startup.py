"""A newcomer's first minutes with the server: start-up phases, the first chat answer, and chat replies while
the background compiles run and after they finished, cold and warm.

    python benchmarks/serve_startup.py [--runs cold,warm] [-- SERVER FLAGS...]
    python benchmarks/serve_startup.py --against-one-device 3 -- --mesh 8

"cold" uses an empty persistent compilation cache (every program compiles), "warm" the cache the cold run
filled. Each run launches `python -m ernie_jax.serve`, polls POST /v1/chat/completions until it answers
(the first answer), then streams a 48-token greedy reply at once (the background compiles still running)
and again once the log says they finished (the server idle): each reply's seconds and its decode rate
(tokens after the first over the seconds after the first). The phases come from the server's log: read
(checkpoint into host memory), place (weights onto the devices), engine (KV pools and start-up programs),
ready (launch to listening).

--against-one-device N: one stream's idle decode rate with the given flags against the one-device server in
the same run: after a cold start of each (filling its own cache), N rounds of a warm start of each, one after
the other, each measuring the median of three idle 48-token replies; prints each round's ratio and the median
(process to process the rate on a small VM varies, so the rounds alternate).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPLY = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48,
         "temperature": 0, "ignore_eos": True, "stream": True}
BACKGROUND_DONE = "more programs compiled in the background"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reply(url: str) -> tuple[float, float]:
    """(seconds for the whole 48-token streamed reply, decode tokens/s after the first token)."""
    t0, stamps = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=REPLY, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    total = time.perf_counter() - t0
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return total, rate


def run(flags: list[str], cache: str, timeout: float = 900, idle_replies: int = 1) -> dict:
    port, log_path = free_port(), tempfile.mktemp(suffix=".log")
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "ernie_jax.serve", "--port", str(port),
                                 "--compilation-cache-dir", cache, *flags], stdout=log_file, stderr=log_file)
    out: dict = {}
    body = {"messages": [{"role": "user", "content": "你好"}], "max_tokens": 8}
    try:
        while "first answer" not in out:
            if time.perf_counter() - t0 > timeout or proc.poll() is not None:
                raise SystemExit(f"no answer (server exit code {proc.poll()}); log: {log_path}")
            try:
                if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code == 200:
                    out["first answer"] = time.perf_counter() - t0
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
        log = open(log_path).read()
        if BACKGROUND_DONE not in log:
            out["reply while compiling"], out["tok/s while compiling"] = reply(url)
        while BACKGROUND_DONE not in open(log_path).read():
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"the background compiles did not finish; log: {log_path}")
            time.sleep(0.5)
        idle = sorted((reply(url) for _ in range(idle_replies)), key=lambda r: r[1])
        out["reply idle"], out["tok/s idle"] = idle[len(idle) // 2]
        log = open(log_path).read()
        if m := re.search(r"start-up: (.*)", log):
            out.update({k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", m.group(1))})
        if m := re.search(r"ready ([\d.]+) s after launch", log):
            out["ready"] = float(m.group(1))
        if m := re.search(r"(\d+) more programs compiled in the background in ([\d.]+) s", log):
            out["background programs"], out["background s"] = int(m.group(1)), float(m.group(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--against-one-device", type=int, default=0, metavar="N",
                    help="N alternated warm rounds: idle one-stream tok/s with FLAGS against one device")
    ap.add_argument("flags", nargs="*", help="server flags (after --), e.g. -- --mesh 8")
    args = ap.parse_args()
    if args.against_one_device:
        return against_one_device(args.flags, args.against_one_device)
    cache = tempfile.mkdtemp(prefix="ernie_jax_startup_cache_")
    for name in args.runs.split(","):
        out = run(args.flags, cache)
        print(f"{name} ({' '.join(args.flags) or 'one device'}): "
              + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items()),
              flush=True)
    return 0


def against_one_device(flags: list[str], rounds: int) -> int:
    setups = {" ".join(flags): flags, "one device": []}
    caches = {name: tempfile.mkdtemp(prefix="ernie_jax_startup_cache_") for name in setups}
    for name, f in setups.items():  # cold: fills the cache, not measured
        run(f, caches[name])
    ratios = []
    for r in range(rounds):
        rates = {name: run(f, caches[name], idle_replies=3)["tok/s idle"] for name, f in setups.items()}
        ratios.append(rates[" ".join(flags)] / rates["one device"])
        print(f"round {r + 1}: " + ", ".join(f"{name} {v:.1f} tok/s" for name, v in rates.items())
              + f"; ratio {ratios[-1]:.2f}", flush=True)
    print(f"one stream, idle, {' '.join(flags)} against one device: {sorted(ratios)[len(ratios) // 2]:.2f}x "
          f"(median of {rounds} rounds)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
