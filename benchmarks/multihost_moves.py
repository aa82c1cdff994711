"""What moving device data costs inside one instance across processes, against the same mesh in one process:
the PD hand-over's page transfer (prefill submesh -> decode submesh) and an EPLB re-placement's expert moves.

    python benchmarks/multihost_moves.py [--measure pages,experts] [--processes 1,2] [--pages 1,4,16,64]
        [--repeats 7] [--out FILE]

Each setup runs the engine's own calls on the embedded model, as a server's processes would make them
(every process builds the same engines; with 2 processes, 4 CPU devices each, under jax.distributed):
- page transfer: an engine with prefill on devices 0-3 and decode on 4-7 (static roles; with 2 processes,
  each submesh is one process's devices and the copy is JAX's cross-host transfer); `PageTransfer.gather`
  of N pages (the gather program on the prefill submesh and the copy onto the decode submesh), timed on
  the process holding the decode submesh until the pages have landed there; median of the repeats.
- expert moves: a colocated engine on `data=1,expert=2,tensor=4` with 8 redundant experts (the expert axis
  crosses the processes); `ModelPrograms.place_experts` into a placement planned from random loads, then
  back, each timed until every local weight shard is ready; median of the repeats.
On a 2-core machine both processes share the two cores, and cross-process copies and collectives go over
loopback (the transfer library's sockets, gloo): the figures show what crosses and its relative cost, not a
GPU deployment's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=128, background_compile=False)
EPLB = {"num_redundant_experts": 8, "window_size": 16, "step_interval": 100000}


def worker(what: str, processes: int, pid: int, port: int, pages: list[int], repeats: int) -> list[dict]:
    import jax
    if processes > 1:
        from ernie_jax.serve.distributed import transfer_address  # a free port of this host, as the server picks
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address(f"127.0.0.1:{port}", None))
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, pid)
    if what == "experts":
        return _expert_moves(processes, pid, repeats)
    import numpy as np

    from ernie_jax import LLM
    rows = []
    llm = LLM(None, mesh=8, prefill_devices=4, pd_policy="static", **SETTINGS)
    transfer = llm.engine.instances[0].transfer
    receiver = any(d.process_index == jax.process_index() for d in transfer.dst.devices)
    for n in pages:
        times, before = [], transfer.bytes
        for i in range(repeats + 2):
            t0 = time.perf_counter()
            jax.block_until_ready(transfer.gather(list(range(1, n + 1))))
            if i >= 2:  # two warm-ups: the gather program of this page bucket compiles on its first call
                times.append(time.perf_counter() - t0)
        if receiver:
            rows.append({"what": "page transfer", "processes": processes, "pages": n,
                         "tokens": n * llm.engine.page_size, "bytes": (transfer.bytes - before) // (repeats + 2),
                         "ms_p50": round(1e3 * float(np.median(times)), 2),
                         "ms_min": round(1e3 * min(times), 2)})
    if processes > 1:
        jax.distributed.shutdown()
    return rows


def _expert_moves(processes: int, pid: int, repeats: int) -> list[dict]:
    import jax
    import numpy as np

    from ernie_jax import LLM
    from ernie_jax.sharding import eplb
    rows = []
    llm = LLM(None, mesh="data=1,expert=2,tensor=4", disaggregate=False, eplb_config=EPLB, **SETTINGS)
    programs = llm.engine.instances[0].programs
    first, cfg = programs.expert_placement, llm.model.config
    load = np.random.default_rng(0).pareto(1.0, (cfg.num_moe_layers, cfg.moe_num_experts)) + 1
    other = eplb.plan(load, EPLB["num_redundant_experts"], first.num_devices)
    times = []
    for i in range(2 * repeats + 2):
        t0 = time.perf_counter()
        programs.place_experts(other if i % 2 == 0 else first)
        jax.block_until_ready(programs.weights)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    expert_bytes = sum(x.nbytes for k in ("experts_up_gate", "experts_down")
                       for seg in programs.weights["segments"]
                       for w in (seg if isinstance(seg, list) else [seg]) if k in w
                       for x in jax.tree.leaves(w[k]))
    if pid == 0:
        rows.append({"what": "expert moves", "processes": processes, "expert_bytes": int(expert_bytes),
                     "ms_p50": round(1e3 * float(np.median(times)), 2), "ms_min": round(1e3 * min(times), 2)})
    if processes > 1:
        jax.distributed.shutdown()
    return rows


def run(what: str, processes: int, pages: list[int], repeats: int) -> list[dict]:
    """The setup's processes (this script again, as workers) for one measurement ("pages" or "experts");
    their rows."""
    sys.path.insert(0, ROOT)
    from tests.serving import free_port  # here only: tests' conftest sets up 8 devices a process on import
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes}",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = ["--pages", ",".join(map(str, pages)), "--repeats", str(repeats)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--worker", what, str(processes), str(port),
                               str(pid)], env=env, stdout=subprocess.PIPE, text=True)
             for pid in range(processes)]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise SystemExit(f"a worker of the {processes}-process setup exited {p.returncode}")
        rows += [json.loads(line[5:]) for line in out.splitlines() if line.startswith("ROW: ")]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--pages", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="append the rows as JSON lines here")
    ap.add_argument("--measure", default="pages,experts")
    ap.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    pages = [int(x) for x in args.pages.split(",")]
    if args.worker:
        what, (processes, port, pid) = args.worker[0], map(int, args.worker[1:])
        for row in worker(what, processes, pid, port, pages, args.repeats):
            print("ROW: " + json.dumps(row), flush=True)
        return 0
    for what, n in ((w, int(x)) for w in args.measure.split(",") for x in args.processes.split(",")):
        for row in run(what, n, pages, args.repeats):
            print(json.dumps(row), flush=True)
            if args.out:  # as each setup ends: a later setup's failure keeps the rows before it
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
