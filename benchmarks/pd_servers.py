"""Prefill/decode across server processes against PD inside one server, on this machine's CPU devices.

    python benchmarks/pd_servers.py [--setups one,split,split2] [--concurrency 1,16,64] [--out FILE]
        [--cost cost8.json cost4.json] [--compile-first]

Setups (the embedded model; each server sets up its own fake CPU devices):
- one:    `python -m ernie_jax.serve --mesh 8 --pd-policy static` (prefill on 4 devices, decode on 4, one process)
- split:  a `--pd-role prefill --mesh 4` server, a `--pd-role decode --mesh 4` server, the router in front
- split2: a prefill server on 4 devices, two decode servers on 2 each, the router in front
For each, `python -m ernie_jax.bench serve` at each concurrency (TTFT and TPOT p50 / p99). For `split`, also
and `split2`, the KV moved per request at several prompt lengths: the prefill server's export seconds and the
decode server's pull seconds and bytes (from /v1/pd/info), and whether it crossed shard by shard (`split`:
both pools on 4 devices) or on one device (`split2`: a 2-device pool takes a 4-device one's pages), to set
against the in-process hand-over
(benchmarks/kv_transfer.py). On a 2-core machine every process shares the same two cores: the figures show
the protocol's costs, not a GPU deployment's speed.
With --cost (cost models fitted to this machine by `python -m ernie_jax.sim.calibrate`), each run's row also
gives the simulator's prediction for the same requests, clients and settings (`predict`): what the engine's
scheduling, the steps' costs and the KV hand-overs account for; HTTP, the router and tokenization are not in it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.serving import free_port, launch, wait_healthy  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMMON = ["--max-model-len", "1024", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]


@contextlib.contextmanager
def setup(name: str):
    """The servers of a setup, up; yields the URL clients send to."""
    procs = []
    try:
        if name == "one":
            procs.append(launch("ernie_jax.serve", COMMON + ["--mesh", "8", "--pd-policy", "static"], optimized=True))
        else:  # the servers register with the router, which starts once they are up and lists them
            port = free_port()
            join = COMMON + ["--router", f"http://127.0.0.1:{port}"]
            procs.append(launch("ernie_jax.serve", join + ["--mesh", "4", "--pd-role", "prefill"], optimized=True))
            decoders = [["--mesh", "4"]] if name == "split" else [["--mesh", "2"], ["--mesh", "2"]]
            procs += [launch("ernie_jax.serve", join + d + ["--pd-role", "decode"], optimized=True) for d in decoders]
        for p in procs:
            wait_healthy(p, time.time() + 900)
        if name == "one":
            yield procs[0]["url"], procs
            return
        router = launch("ernie_jax.router", ["--prefill", procs[0]["url"], "--decode",
                                             *[p["url"] for p in procs[1:]], "--api-key", KEY], port=port)
        procs.append(router)
        wait_healthy(router, time.time() + 60)
        yield router["url"], procs
    finally:
        for p in procs:
            p["proc"].kill()
            p["proc"].wait()


def serve_bench(url: str, concurrency: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        n = max(8, 2 * concurrency)
        subprocess.run([sys.executable, "-m", "ernie_jax.bench", "serve", "--url", url, "--api-key", KEY,
                        "--num-prompts", str(n), "--concurrency", str(concurrency), "--input-len", "128",
                        "--output-len", "32", "--warmup", "2", "--json", f.name], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        m = json.load(open(f.name))
    return {k: m[k] for k in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
                              "input_lens", "output_lens") if k in m}


# Each setup's instances as the simulator lays them out: (home role, devices).
LAYOUTS = {"one": (("prefill", 4), ("decode", 4)), "split": (("prefill", 4), ("decode", 4)),
           "split2": (("prefill", 4), ("decode", 2), ("decode", 2))}


def predict(name: str, measured: dict, concurrency: int, costs: list, transfer_rows: list[dict]) -> dict:
    """The simulator's TTFT / TPOT for the run just measured: the same requests (lengths from the benchmark's
    own record), the same closed loop of `concurrency` clients, the servers' settings, and a cost model fitted
    to this machine (`python -m ernie_jax.sim.calibrate`; the first file that measured an instance size gives
    its step costs). Between servers, the hand-over costs what this setup's transfer rows measured (export +
    pull per KV token, at the prompt length nearest the benchmark's); inside one server, the fitted hand-over."""
    import math
    import numpy as np
    from ernie_jax.sim.simulator import SimConfig, simulate
    from ernie_jax.sim.traces import TraceRequest

    coefficients = {}
    for c in reversed(costs):
        coefficients.update(c.coefficients)
    sizes = {d for _, d in LAYOUTS[name]}
    if sizes - set(coefficients):
        raise SystemExit(f"--cost: no cost model measured instances of {sorted(sizes - set(coefficients))} devices "
                         f"(fitted: {sorted(coefficients)}); calibrate with --mesh twice that")
    block = costs[0].settings["block_size"]
    max_num_seqs, max_model_len, batched = (int(COMMON[COMMON.index(f) + 1]) for f in
                                            ("--max-num-seqs", "--max-model-len", "--max-num-batched-tokens"))
    transfer = costs[0].transfer_per_token
    if transfer_rows:
        row = min(transfer_rows, key=lambda t: abs(t["prompt_tokens"] - np.median(measured["input_lens"])))
        transfer = (row["gather_ms"] + row["pull_ms"]) / 1e3 / row["prompt_tokens"]
    pages = math.ceil(max_num_seqs * max_model_len / block) + 1  # the servers' pools: no memory limit on CPU
    cost = dataclasses.replace(costs[0], coefficients=coefficients, num_pages=dict.fromkeys(coefficients, pages),
                               transfer_per_token=transfer)
    trace = [TraceRequest(0.0, int(i), int(o)) for i, o in zip(measured["input_lens"], measured["output_lens"])]
    cfg = SimConfig("static", 8, instances=LAYOUTS[name], max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                    block_size=block, max_model_len=max_model_len,
                    min_decode_rows=costs[0].settings.get("min_decode_rows", 1))
    r = simulate(trace, cost, cfg, concurrency=concurrency)
    ttft, tpot = r.ttft() * 1e3, r.tpot() * 1e3
    return {"p50_ttft_ms": float(np.median(ttft)), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "p50_tpot_ms": float(np.median(tpot)), "p99_tpot_ms": float(np.percentile(tpot, 99))}


def transfer(procs: list[dict], lengths=(64, 128, 256, 512, 960)) -> list[dict]:
    """KV moved per request, by prompt length: one request at a time through the router."""
    prefill, decoders, router = procs[0]["url"], [p["url"] for p in procs[1:-1]], procs[-1]["url"]
    info = lambda u: httpx.get(u + "/v1/pd/info", headers=AUTH, timeout=120).json()["transfers"]  # noqa: E731

    def decode_totals() -> dict:  # summed over the decode servers, whichever the router chose
        each = [info(u) for u in decoders]
        return {k: sum(t.get(k, 0) for t in each) for k in ("bytes", "seconds", "pulled_sharded")}
    out = []
    for n in lengths:
        p0, d0 = info(prefill), decode_totals()
        reps = 5
        for i in range(reps):
            body = {"prompt": [10 + (7 * j + i) % 900 for j in range(n)], "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(router + "/v1/completions", json=body, headers=AUTH, timeout=300)
            r.raise_for_status()
        p1, d1 = info(prefill), decode_totals()
        mb = (d1["bytes"] - d0["bytes"]) / reps / 1e6
        pull = (d1["seconds"] - d0["seconds"]) / reps
        sharded = d1.get("pulled_sharded", 0) - d0.get("pulled_sharded", 0)
        out.append({"prompt_tokens": n, "MB": round(mb, 3), "gather_ms": round((p1["seconds"] - p0["seconds"])
                                                                             / reps * 1e3, 2),
                    "pull_ms": round(pull * 1e3, 2), "GB/s": round(mb / 1e3 / pull, 3) if pull else None,
                    "path": "shard by shard" if sharded == reps else "one device" if not sharded else "mixed"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setups", default="one,split,split2")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--compile-first", action="store_true",
                    help="servers compile every program before ready (--no-background-compile): no compile beside "
                         "the measured requests")
    ap.add_argument("--cost", nargs="+", default=None, metavar="FILE",
                    help="fitted cost models (python -m ernie_jax.sim.calibrate --mesh 8, and --mesh 4 for split2's "
                         "2-device decode servers): print the simulator's prediction beside each run")
    args = ap.parse_args()
    if args.compile_first:
        COMMON.append("--no-background-compile")
    costs = None
    if args.cost:
        from ernie_jax.sim.cost import FittedCost
        costs = [FittedCost.load(f) for f in args.cost]
    results = {}
    for name in args.setups.split(","):
        with setup(name) as (url, procs):
            r = {"serve": {c: serve_bench(url, int(c)) for c in args.concurrency.split(",")}}
            if name in ("split", "split2"):
                r["transfer"] = transfer(procs)
            if args.cost:
                r["predicted"] = {c: predict(name, m, int(c), costs, r.get("transfer", []))
                                  for c, m in r["serve"].items()}
            for m in r["serve"].values():
                del m["input_lens"], m["output_lens"]
            results[name] = r
            print(name, json.dumps(r), flush=True)
    print("| setup | concurrency | TTFT p50 / p99 ms | TPOT p50 / p99 ms | output tok/s |"
          + (" simulated TTFT p50 / p99 ms | simulated TPOT p50 / p99 ms |" if args.cost else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.cost else ""))
    for name, r in results.items():
        for c, m in r["serve"].items():
            row = (f"| {name} | {c} | {m['p50_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | "
                   f"{m['p50_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | {m['output_throughput']:.1f} |")
            if args.cost:
                p = r["predicted"][c]
                row += (f" {p['p50_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | {p['p50_tpot_ms']:.1f} / "
                        f"{p['p99_tpot_ms']:.1f} |")
            print(row)
    rows = [(name, t) for name in ("split", "split2") if name in results for t in results[name]["transfer"]]
    if rows:
        print("\n| setup | prompt tokens | KV MB | export ms (prefill) | pull ms (decode) | pull GB/s | path |")
        print("|---|---|---|---|---|---|---|")
        for name, t in rows:
            print(f"| {name} | {t['prompt_tokens']} | {t['MB']} | {t['gather_ms']} | {t['pull_ms']} | {t['GB/s']} | "
                  f"{t['path']} |")
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
