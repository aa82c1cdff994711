"""One instance over two processes (jax.distributed) against the same mesh in one process, on this
machine's CPU devices.

    python benchmarks/multihost.py [--mesh data=1,expert=2,tensor=4] [--setups one,two] [--concurrency 1,16]
        [--out FILE]

Setups (the embedded model on an 8-device mesh, each process setting up its own fake CPU devices):
- one: `python -m ernie_jax.serve --mesh MESH --no-disaggregate` (one process, 8 devices, colocated)
- two: the same with `--num-processes 2`: a leader and a follower with 4 devices each (engine/multihost.py)
- pd-one: `--mesh 8 --prefill-devices 4 --pd-policy static` in one process (prefill on devices 0-3, decode
  on 4-7, every request handed over)
- pd-two: the same over two processes: prefill on the leader's 4 devices, decode on the follower's (the
  pages and the decode results the leader reads cross with JAX's cross-host transfers)
For each, `python -m ernie_jax.bench serve` at each concurrency (TPOT and TTFT p50, output tok/s); for `two`,
the leader's channel totals from its log after a drained stop: calls sent to the follower, bytes, and the
leader's seconds encoding and sending them (the per-step host cost of the broadcast). On a 2-core machine
both processes share the two cores and the cross-process collectives run over gloo on loopback: the
figures show the protocol's costs, not a GPU deployment's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.serving import free_port, launch, wait_healthy  # noqa: E402

KEY = "test-key"
COMMON = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "128", "--no-background-compile"]
PD = ["--prefill-devices", "4", "--pd-policy", "static"]



@contextlib.contextmanager
def setup(name: str, mesh: str):
    """The processes of a setup, up; yields (the URL clients send to, the processes)."""
    engine = COMMON + (PD + ["--mesh", "8"] if name.startswith("pd-") else ["--no-disaggregate", "--mesh", mesh])
    if name in ("one", "pd-one"):
        procs = [launch("ernie_jax.serve", engine, optimized=True)]
    else:
        job = engine + ["--num-processes", "2", "--coordinator-address", f"127.0.0.1:{free_port()}"]
        procs = [launch("ernie_jax.serve", job + ["--process-id", "0"], optimized=True),
                 launch("ernie_jax.serve", job + ["--process-id", "1"], optimized=True)]
    try:
        for p in procs:
            wait_healthy(p, time.time() + 1200)
        yield procs[0]["url"], procs
    finally:
        for p in procs:
            if p["proc"].poll() is None:
                p["proc"].kill()
                p["proc"].wait()


def serve_bench(url: str, concurrency: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "ernie_jax.bench", "serve", "--url", url, "--api-key", KEY,
                        "--num-prompts", str(max(4, 2 * concurrency)), "--concurrency", str(concurrency),
                        "--input-len", "64", "--output-len", "48", "--warmup", "2", "--json", f.name],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        m = json.load(open(f.name))
    return {k: m[k] for k in ("p50_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput") if k in m}


def channel_totals(leader: dict) -> dict:
    """Stop the leader (drained) and read its channel line."""
    leader["proc"].send_signal(signal.SIGTERM)
    leader["proc"].wait(timeout=120)
    text = open(leader["log"]).read()
    m = re.search(r"leader channel: (\d+) calls sent, (\d+) bytes, ([\d.]+) s encoding and sending", text)
    if m is None:
        return {}
    calls, nbytes, seconds = int(m[1]), int(m[2]), float(m[3])
    return {"calls": calls, "bytes": nbytes, "send_seconds": seconds, "us_per_call": round(1e6 * seconds / calls, 1),
            "bytes_per_call": round(nbytes / calls)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="data=1,expert=2,tensor=4",
                    help="one and two's mesh: the default splits heads within a process and experts across the two "
                         "(the layout of one instance over two hosts); 8 splits heads 8 ways, across the processes")
    ap.add_argument("--setups", default="one,two,pd-one,pd-two")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--out", default=None, help="append the results as JSON lines here")
    args = ap.parse_args()
    results = []
    for name in args.setups.split(","):
        with setup(name, args.mesh) as (url, procs):
            for c in (int(x) for x in args.concurrency.split(",")):
                row = {"setup": name, "mesh": "8: prefill 4 + decode 4" if name.startswith("pd-") else args.mesh,
                       "concurrency": c, **serve_bench(url, c)}
                print(json.dumps(row), flush=True)
                results.append(row)
            if name.endswith("two"):
                row = {"setup": name, "channel": channel_totals(procs[0])}
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.out:
        with open(args.out, "a") as f:
            for row in results:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
