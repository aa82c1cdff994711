"""Role switching across servers: a prompt burst's TTFT through a static and a dynamic router over the same
prefill and decode servers, in alternating rounds.

    python benchmarks/pd_role_switch.py [--rounds 4] [--burst 12] [--prompt-len 200]
        [--max-num-batched-tokens 16] [--decode-servers 2]

One prefill server on 4 CPU devices and `--decode-servers` decode servers on 2 each (the embedded model,
XLA's default optimisation), a `--pd-policy static` and a `--pd-policy dynamic` router in front of them.
After a warm-up burst through each router, every round sends one burst of `--burst` streamed prompts through
each router, one router after the other, the order alternating from round to round (static first in odd
rounds); every burst's prompts share no prefix with any other prompt of the run, so no burst finds another's
KV cached. Prints each burst's TTFT p50, the prompts the decode servers took whole in it (the dynamic
router's counter), and per policy the TTFT p50 and p99 over all its bursts' requests, and their ratio.
On a 2-core machine every process shares the same two cores: a decode server that prefills takes CPU time
from the prefill server, so single bursts vary; the pooled figures are the comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.serving import KEY, free_port, launch, prompt_burst, taken_whole, wait_healthy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--burst", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16)
    ap.add_argument("--decode-servers", type=int, default=2)
    args = ap.parse_args()
    ports = {"static": free_port(), "dynamic": free_port()}  # the servers register with the dynamic router
    common = ["--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--no-background-compile", "--router",
              f"http://127.0.0.1:{ports['dynamic']}"]
    servers = [launch("ernie_jax.serve", common + ["--mesh", "4", "--pd-role", "prefill"], optimized=True)]
    servers += [launch("ernie_jax.serve", common + ["--mesh", "2", "--pd-role", "decode"], optimized=True)
                for _ in range(args.decode_servers)]
    procs = list(servers)
    try:
        for s in servers:
            wait_healthy(s, time.time() + 900)
        decode_urls = [s["url"] for s in servers[1:]]
        routers = {}
        for policy in ("static", "dynamic"):
            routers[policy] = launch("ernie_jax.router", ["--prefill", servers[0]["url"], "--decode", *decode_urls,
                                                          "--api-key", KEY, "--pd-policy", policy],
                                     port=ports[policy])
            procs.append(routers[policy])
            wait_healthy(routers[policy], time.time() + 60)
        first = 0
        for policy, r in routers.items():  # warm-up: every server has run the shapes once
            prompt_burst(r["url"], 2, first, args.prompt_len)
            first += 2
        ttft: dict[str, list[float]] = {"static": [], "dynamic": []}
        print(f"{args.burst}-prompt bursts of {args.prompt_len} tokens, 1 prefill server (4 devices) + "
              f"{args.decode_servers} decode servers (2 each), --max-num-batched-tokens {args.max_num_batched_tokens}")
        for i in range(args.rounds):
            order = ("static", "dynamic") if i % 2 == 0 else ("dynamic", "static")
            line = []
            for policy in order:
                before = taken_whole(routers["dynamic"]["url"], decode_urls)
                t = prompt_burst(routers[policy]["url"], args.burst, first, args.prompt_len)
                first += args.burst
                whole = taken_whole(routers["dynamic"]["url"], decode_urls) - before
                ttft[policy] += t
                line.append(f"{policy} p50 {np.median(t):.2f} s" + (f" ({whole:.0f} whole on decode)"
                                                                     if policy == "dynamic" else ""))
            print(f"round {i + 1}: " + ", ".join(line), flush=True)
        p50 = {k: float(np.median(v)) for k, v in ttft.items()}
        for policy, v in ttft.items():
            print(f"{policy}: TTFT p50 {p50[policy]:.2f} s, p99 {np.percentile(v, 99):.2f} s over {len(v)} requests")
        print(f"dynamic / static TTFT p50: {p50['dynamic'] / p50['static']:.2f}")
    finally:
        for p in procs:
            p["proc"].kill()
            p["proc"].wait()


if __name__ == "__main__":
    main()
