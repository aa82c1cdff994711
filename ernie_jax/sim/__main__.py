"""`python -m ernie_jax.sim --trace all --cost h200 --rate 8`: goodput, TTFT/TPOT percentiles and instance
utilisation of colocated, static PD and dynamic PD (also with the SLOs as the policy's TTFT / TPOT
targets) per trace, and the best static split of the devices.

--cost h200: the 8xH200 roofline model (cost.H200Cost); h800: H800 nodes (cost.h800_cost); --cost FILE.json: a
model fitted to a machine by `python -m ernie_jax.sim.calibrate` (cost.FittedCost; only the instance sizes it
measured).
Goodput: requests per second, over the trace's arrival span, that met both --ttft-slo and --tpot-slo
(DistServe's per-request SLO attainment); the defaults are the cost model's targets.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ernie_jax.engine.policy import PDPolicy
from ernie_jax.sim.cost import COSTS, FittedCost, feasible_splits
from ernie_jax.sim.simulator import SimConfig, simulate
from ernie_jax.sim.traces import TRACES, make_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="all", help=f"one of {TRACES} or 'all'")
    ap.add_argument("--cost", default="h200", help="h200, h800, or a fitted model's .json (sim.calibrate)")
    ap.add_argument("--rate", type=float, nargs="+", default=[8.0], help="mean arrivals per second")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--prefill-devices", type=int, default=None, help="default: half")
    # Default: the cost model's own settings (H200: 128, 2048, 16384, scale 1; fitted: what it measured).
    ap.add_argument("--max-num-seqs", type=int, default=None, help="batch seats per instance")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--scale", type=float, default=None, help="multiply every trace length")
    ap.add_argument("--ttft-slo", type=float, default=None)
    ap.add_argument("--tpot-slo", type=float, default=None)
    ap.add_argument("--splits", action="store_true", help="also try every static prefill:decode split")
    args = ap.parse_args(argv)
    cost = COSTS[args.cost]() if args.cost in COSTS else FittedCost.load(args.cost)
    settings = dict(cost.settings)  # SimConfig fields, and the trace scale
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "scale"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    scale, max_model_len = settings.pop("scale"), settings["max_model_len"]
    ttft, tpot = args.ttft_slo or cost.ttft_slo, args.tpot_slo or cost.tpot_slo
    traces = TRACES if args.trace == "all" else (args.trace,)
    n_prefill = args.prefill_devices or args.devices // 2
    print(f"cost model: {cost.name}; SLO TTFT <= {ttft:g} s, TPOT <= {tpot * 1e3:g} ms; {args.num_requests} requests "
          f"per trace (lengths x {scale:g}); {args.devices} devices (PD {n_prefill}:{args.devices - n_prefill}); "
          f"max_num_seqs {settings['max_num_seqs']}, max_num_batched_tokens {settings['max_num_batched_tokens']}, "
          f"max_model_len {max_model_len}")
    print("| trace | rate | mode | goodput req/s | SLO met | TTFT p50 / p99 s | TPOT p50 / p99 ms | utilisation | "
          "role switches |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in traces:
        for rate in args.rate:
            trace = make_trace(name, rate, args.num_requests, scale=scale, max_model_len=max_model_len)
            span = trace[-1].arrival - trace[0].arrival
            targeted = PDPolicy("dynamic", ttft_target=ttft, tpot_target=tpot)
            for label, mode, policy in (("colocated", "colocated", None), ("static", "static", None),
                                        ("dynamic", "dynamic", None), ("dynamic, SLO targets", "dynamic", targeted)):
                r = simulate(trace, cost, SimConfig(mode, args.devices, n_prefill, **settings), policy)
                t, p = r.ttft(), r.tpot() * 1e3
                util = ", ".join(f"{k} {v:.0%}" for k, v in r.utilisation.items())
                switches = sum(n for (_, src, dst), n in r.role_switches.items() if src != dst)
                print(f"| {name} | {rate:g} | {label} | {r.goodput(ttft, tpot, span):.2f} | {r.attained(ttft, tpot):.0%} | "
                      f"{np.median(t):.2f} / {np.percentile(t, 99):.2f} | {np.median(p):.1f} / {np.percentile(p, 99):.1f} "
                      f"| {util} | {switches} |")
            if args.splits:
                best = max(((k, simulate(trace, cost, SimConfig("static", args.devices, k, **settings)))
                            for k in feasible_splits(cost, args.devices, settings["block_size"])),
                           key=lambda kr: kr[1].goodput(ttft, tpot, span))
                print(f"| {name} | {rate:g} | best static split {best[0]}:{args.devices - best[0]} | "
                      f"{best[1].goodput(ttft, tpot, span):.2f} | {best[1].attained(ttft, tpot):.0%} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
