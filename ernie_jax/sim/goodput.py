"""Goodput as the disaggregation papers measure it (DistServe): the highest offered request rate at which at
least 90 % of the requests meet both their TTFT and TPOT targets, per device, for each trace, serving mode
and SLO pair, over several trace seeds.

    python -m ernie_jax.sim.goodput [--traces shifting,sharegpt,...] [--slos tight,medium,loose] [--seeds 3]
                                    [--cost h200|h800] [--devices 8] [--instances N] [--out FILE.json]

Modes: colocated on all devices (chunked prefill), every static prefill:decode split the cost model can
hold, and dynamic PD on the even split (it has to find its balance without being told the best split), with
the policy's defaults and with the SLO pair as its TTFT / TPOT targets ("dynamic+SLO"). With
`--instances N`: N instances of `--devices` each behind a router (one a node, e.g. 300B-FP8 on H800 nodes):
N mixed instances, every static prefill:decode count, and dynamic from the even count, where whole instances
also switch roles (PDPolicy.instance_roles) once there are more than two. The last column: role switches a
minute at the goodput rate (whole instances, and a pair's instances taking the other role's work).
For one (trace, mode, SLO, seed) the attainment is measured by simulating `--duration` seconds of arrivals at
that rate (rate x duration requests, so a higher rate is a longer queue, not a shorter trace; the shifting
trace's four phases a quarter of it each); the search doubles the rate until attainment falls below the
target, then bisects. The table gives each mode's rate as mean +- the half-width of a 95 %
t-interval over seeds; "best static" is, per seed, the best split's rate. `--curve` also prints attainment
against rate for one trace and SLO (the notebook plots it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from ernie_jax.engine.policy import PDPolicy
from ernie_jax.sim.cost import COSTS, FittedCost, feasible_splits
from ernie_jax.sim.simulator import SimConfig, simulate
from ernie_jax.sim.traces import TRACES, make_trace

# (TTFT seconds, TPOT seconds) relative to the cost model's own targets (H200: 2 s, 50 ms)
SLO_FACTORS = {"tight": 0.5, "medium": 1.0, "loose": 2.0}
ATTAINMENT = 0.9
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # t(0.975, n - 1)


@dataclasses.dataclass(frozen=True)
class Mode:
    label: str  # "colocated", "static 3:5", "dynamic 4:4", "dynamic+SLO 4:4"
    mode: str  # SimConfig.mode
    prefill_devices: int = 0
    targets: bool = False  # dynamic: the SLO pair as the policy's ttft_target / tpot_target
    instances: tuple = ()  # SimConfig.instances: (home role, devices) each, behind a router


def modes(cost, devices: int, page_size: int) -> list[Mode]:
    out = [Mode("colocated", "colocated")]
    out += [Mode(f"static {k}:{devices - k}", "static", k) for k in feasible_splits(cost, devices, page_size)]
    half = devices // 2
    out.append(Mode(f"dynamic {half}:{devices - half}", "dynamic", half))
    out.append(Mode(f"dynamic+SLO {half}:{devices - half}", "dynamic", half, targets=True))
    return out


def instance_modes(count: int, per_instance: int) -> list[Mode]:
    """Modes of `count` instances of `per_instance` devices each (one a node, behind a router): colocated
    (mixed instances), every static prefill:decode count, dynamic from the even split (the pair's rules and
    whole-instance switching), with and without the SLO pair as targets."""
    node = lambda role, k: ((role, per_instance),) * k  # noqa: E731
    half = count // 2
    even = node("prefill", half) + node("decode", count - half)
    return ([Mode(f"colocated x{count}", "colocated", instances=node("mixed", count))]
            + [Mode(f"static {k}:{count - k}", "static", instances=node("prefill", k) + node("decode", count - k))
               for k in range(1, count)]
            + [Mode(f"dynamic {half}:{count - half}", "dynamic", instances=even),
               Mode(f"dynamic+SLO {half}:{count - half}", "dynamic", targets=True, instances=even)])


class Sweep:
    """Attainment of one (trace, seed, SLO) at any rate, per mode; memoised."""

    def __init__(self, cost, settings: dict, trace: str, seed: int, slo: tuple[float, float], devices: int,
                 duration: float):
        self.cost, self.settings, self.trace, self.seed, self.slo = cost, dict(settings), trace, seed, slo
        self.devices, self.duration = devices, duration
        self._memo: dict[tuple[str, float], float] = {}
        self.switches: dict[tuple[str, float], float] = {}  # role switches per minute of the run

    def attainment(self, mode: Mode, rate: float) -> float:
        key = (mode.label, round(rate, 6))
        if key not in self._memo:
            settings = dict(self.settings)
            scale = settings.pop("scale")
            trace = make_trace(self.trace, rate, max(20, round(rate * self.duration)), seed=self.seed, scale=scale,
                               max_model_len=settings["max_model_len"],
                               phase_seconds=self.duration / 4 if self.trace == "shifting" else None)
            policy = PDPolicy("dynamic", ttft_target=self.slo[0], tpot_target=self.slo[1]) if mode.targets else None
            r = simulate(trace, self.cost, SimConfig(mode.mode, self.devices, mode.prefill_devices,
                                                     instances=mode.instances, **settings), policy)
            self._memo[key] = r.attained(*self.slo)
            self.switches[key] = (len(r.instance_switches) + sum(r.role_switches.values())) / (r.duration / 60)
        return self._memo[key]

    def max_rate(self, mode: Mode, start: float, steps: int = 5) -> float:
        """The highest rate with attainment >= ATTAINMENT, to a factor of 2**(1 / 2**steps) or so."""
        lo, hi = 0.0, start
        while self.attainment(mode, hi) >= ATTAINMENT:
            lo, hi = hi, hi * 2
            if hi > 1e3:
                raise RuntimeError(f"{self.trace}, {mode.label}: the SLO is still met at {hi:g} req/s")
        if lo == 0.0:  # not met at the starting rate: search below it
            lo = start / 64
            if self.attainment(mode, lo) < ATTAINMENT:
                return 0.0
        for _ in range(steps):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if self.attainment(mode, mid) >= ATTAINMENT else (lo, mid)
        return lo


def interval(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval."""
    a = np.asarray(xs, float)
    if len(a) < 2:
        return float(a.mean()), float("nan")
    return float(a.mean()), float(T95.get(len(a) - 1, 1.96) * a.std(ddof=1) / np.sqrt(len(a)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.sim.goodput", description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default="prompt-heavy,decode-heavy,sharegpt,shifting",
                    help=f"comma-separated, from {TRACES}")
    ap.add_argument("--slos", default="tight,medium,loose", help=f"comma-separated, from {tuple(SLO_FACTORS)}")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cost", default="h200", help=f"one of {tuple(COSTS)}, or a fitted model's .json (sim.calibrate)")
    ap.add_argument("--devices", type=int, default=8, help="devices in all (with --instances: per instance)")
    ap.add_argument("--instances", type=int, default=0,
                    help="instances of --devices each behind a router (one a node); 0: one deployment of --devices "
                         "split into submeshes")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per simulated run")
    ap.add_argument("--start-rate", type=float, default=4.0, help="requests/s where the search starts")
    ap.add_argument("--curve", default=None, metavar="TRACE:SLO", help="print attainment against rate for one pair")
    ap.add_argument("--out", default=None, help="write every figure as JSON")
    args = ap.parse_args(argv)
    cost = COSTS[args.cost]() if args.cost in COSTS else FittedCost.load(args.cost)
    if args.instances == 1 or args.instances < 0:
        ap.error("--instances: 0 (one deployment) or at least 2")
    devices = args.devices * max(1, args.instances)
    settings = dict(cost.settings)
    traces, slos = args.traces.split(","), args.slos.split(",")
    for name in traces:
        if name not in TRACES:
            ap.error(f"--traces: {name!r} is not one of {TRACES}")
    for name in slos:
        if name not in SLO_FACTORS:
            ap.error(f"--slos: {name!r} is not one of {tuple(SLO_FACTORS)}")
    all_modes = instance_modes(args.instances, args.devices) if args.instances else \
        modes(cost, args.devices, settings["block_size"])
    colocated = all_modes[0].label
    layout = f"{args.instances} instances of {args.devices}" if args.instances else f"{devices} devices"
    print(f"cost model: {cost.name}; {layout}; goodput = the highest rate (req/s) with >= "
          f"{ATTAINMENT:.0%} of requests meeting TTFT and TPOT; mean +- 95 % interval over {args.seeds} seeds")
    print("| trace | SLO (TTFT s / TPOT ms) | colocated | best static (split) | dynamic | dynamic+SLO | "
          "best dynamic / best static | per device: best static / best dynamic | role switches a minute "
          "(dynamic / +SLO) |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = []
    for trace in traces:
        for slo_name in slos:
            f = SLO_FACTORS[slo_name]
            slo = (cost.ttft_slo * f, cost.tpot_slo * f)
            per_mode: dict[str, list[float]] = {m.label: [] for m in all_modes}
            switches: dict[str, list[float]] = {m.label: [] for m in all_modes}  # per minute, at the goodput rate
            for seed in range(args.seeds):
                sweep = Sweep(cost, settings, trace, seed, slo, devices, args.duration)
                for m in all_modes:
                    rate = sweep.max_rate(m, args.start_rate)
                    per_mode[m.label].append(rate)
                    switches[m.label].append(sweep.switches.get((m.label, round(rate, 6)), 0.0))
            statics = [m.label for m in all_modes if m.mode == "static"]
            best_per_seed = [max(per_mode[s][i] for s in statics) for i in range(args.seeds)]
            best_split = max(statics, key=lambda s: np.mean(per_mode[s]))
            dyn, dyn_slo = (next(m.label for m in all_modes if m.mode == "dynamic" and m.targets == t)
                            for t in (False, True))
            (c, ci_c), (b, ci_b), (d, ci_d), (e, ci_e) = (
                interval(per_mode[colocated]), interval(best_per_seed), interval(per_mode[dyn]),
                interval(per_mode[dyn_slo]))
            ratio = max(d, e) / b if b else float("nan")
            print(f"| {trace} | {slo_name} ({slo[0]:g} / {slo[1] * 1e3:g}) | {c:.2f} +- {ci_c:.2f} | "
                  f"{b:.2f} +- {ci_b:.2f} ({best_split.split()[1]}) | {d:.2f} +- {ci_d:.2f} | {e:.2f} +- {ci_e:.2f} | "
                  f"{ratio:.2f} | {b / devices:.3f} / {max(d, e) / devices:.3f} | "
                  f"{np.mean(switches[dyn]):.1f} / {np.mean(switches[dyn_slo]):.1f} |", flush=True)
            results.append({"trace": trace, "slo": slo_name, "ttft_slo": slo[0], "tpot_slo": slo[1],
                            "rates": per_mode, "best_static_per_seed": best_per_seed, "best_split": best_split,
                            "switches_per_minute": switches})
    if args.curve:
        trace, slo_name = args.curve.split(":")
        f = SLO_FACTORS[slo_name]
        sweep = Sweep(cost, settings, trace, 0, (cost.ttft_slo * f, cost.tpot_slo * f), devices, args.duration)
        rates = [args.start_rate * 2 ** (k / 2) for k in range(-4, 7)]
        print(f"\nattainment against rate, {trace}, {slo_name} (seed 0)")
        print("| rate | " + " | ".join(m.label for m in all_modes) + " |")
        print("|---" * (len(all_modes) + 1) + "|")
        curve = []
        for rate in rates:
            row = [sweep.attainment(m, rate) for m in all_modes]
            curve.append({"rate": rate, **{m.label: a for m, a in zip(all_modes, row)}})
            print(f"| {rate:.2f} | " + " | ".join(f"{a:.0%}" for a in row) + " |", flush=True)
        results.append({"curve": {"trace": trace, "slo": slo_name, "points": curve}})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"cost": cost.name, "devices": devices, "instances": args.instances, "seeds": args.seeds,
                       "results": results}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
