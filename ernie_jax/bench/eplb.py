"""`python -m ernie_jax.bench eplb`: how even expert-parallel load gets with redundant experts (EPLB placement).

Two routings, each measured on one window of tokens and placed by `sharding/eplb.plan`, then judged on
that window and on a fresh one (a placement is computed from the past and serves the future):
- the trained embedded model's real routing on held-out text: per MoE layer, the tokens routed to each
  expert (`--loads`, the `expert_load` of `python -m ernie_jax.train.evaluate`'s JSON; the fresh window is
  the second window when the file holds two, else the same), over `--devices` EP devices;
- ERNIE-4.5-300B's shape with a synthetic skewed router: 64 experts, top-8, 51 MoE layers, EP 8; each layer's
  expert popularity is Zipf(`--zipf`) in a random order, and each token picks 8 distinct experts by it.
Reported for R = 0 (re-packing only) and each `--redundant`: balancedness (mean over max tokens per device,
vLLM's metric; 1.0 is even) without EPLB (expert e on device e // (E / D)) and with it, and the max / mean
device load. Then the simulated 300B MoE time per step (sum over layers of the slowest device: its routed
rows' FP8 FLOPs and its expert slots' weight bytes, at the H200 rates of sim/cost.py H200Cost)
at decode and prefill token counts: redundant slots add weight bytes, so EPLB pays where steps are
compute-bound.
"""

from __future__ import annotations

import json

import numpy as np

from ernie_jax.sharding import eplb

H_300B, F_300B, E_300B, K_300B, L_300B = 8192, 3584, 64, 8, 51


def zipf_loads(rng, tokens: int, layers: int = L_300B, experts: int = E_300B, k: int = K_300B, s: float = 1.0,
               order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[L, E] assignments of `tokens` tokens routed top-k by per-layer Zipf(s) popularity (Gumbel top-k: k
    distinct experts per token); `order` [L, E] fixes each layer's popularity ranking (drawn when None)."""
    if order is None:
        order = np.stack([rng.permutation(experts) for _ in range(layers)])
    logp = -s * np.log(np.arange(1, experts + 1))
    out = np.zeros((layers, experts), np.int64)
    for layer in range(layers):
        scores = logp[np.argsort(order[layer])] + rng.gumbel(size=(tokens, experts))
        picks = np.argpartition(-scores, k, axis=1)[:, :k]
        out[layer] = np.bincount(picks.ravel(), minlength=experts)
    return out, order


def moe_seconds(device_rows: np.ndarray, slots_per_device: int) -> float:
    """Simulated MoE time of one step on ERNIE-4.5-300B: per layer the slowest device (its routed rows' FP8
    FLOPs, and reading its expert slots' FP8 weights; they overlap, so the larger counts), summed."""
    from ernie_jax.sim.cost import H200Cost
    c = H200Cost()
    flops = device_rows.max(-1) * 2 * 3 * H_300B * F_300B / (c.fp8_flops * c.decode_flops_efficiency)
    weights = slots_per_device * 3 * H_300B * F_300B / (c.hbm_bandwidth * c.hbm_efficiency)
    return float(np.maximum(flops, weights).sum())


def table(name: str, measured: np.ndarray, fresh: np.ndarray, devices: int, redundant: list[int]) -> list[str]:
    L, E = measured.shape
    before = eplb.identity_placement(L, E, devices)
    rows = [f"| {name} | without EPLB | {before_after(before, measured, fresh)} |"]
    for R in redundant:
        placed = eplb.plan(measured, R, devices)
        rows.append(f"| {name} | R = {R} ({placed.slots_per_device} slots per device) | "
                    f"{before_after(placed, measured, fresh)} |")
    return rows


def before_after(p: eplb.Placement, measured: np.ndarray, fresh: np.ndarray) -> str:
    cells = []
    for load in (measured, fresh):
        dev = p.device_load(load)
        cells.append(f"{eplb.balancedness(dev).mean():.3f} | {(dev.max(-1) / dev.mean(-1)).max():.2f}")
    return " | ".join(cells)


def run(args) -> int:
    redundant = [int(r) for r in args.redundant.split(",")]
    print("| routing | placement | balancedness (mean over layers) | worst max/mean | balancedness, fresh window | "
          "worst max/mean, fresh |")
    print("|---|---|---|---|---|---|")
    if args.loads:
        with open(args.loads) as f:
            loads = np.asarray(json.load(f)["expert_load"], np.float64)
        loads = loads.reshape(-1, *loads.shape[-2:])  # [windows, L, E]
        measured, fresh = loads[0], loads[-1]
        same = " (one window: fresh = measured)" if len(loads) == 1 else ""
        for row in table(f"embedded model, held-out text ({measured.shape[1]} experts, EP {args.devices}){same}",
                         measured, fresh, args.devices, redundant):
            print(row)
    rng = np.random.default_rng(args.seed)
    measured, order = zipf_loads(rng, args.tokens, s=args.zipf)
    fresh, _ = zipf_loads(rng, args.tokens, s=args.zipf, order=order)
    for row in table(f"300B shape, Zipf({args.zipf}) router, {args.tokens} tokens (EP 8)", measured, fresh, 8,
                     redundant):
        print(row)
    print("\nSimulated 300B MoE time per step (51 layers, EP 8, H200 FP8 rates), placement from the measured "
          "window, traffic from a fresh one:")
    print("| tokens per step | without EPLB | " + " | ".join(f"R = {R}" for R in redundant) + " |")
    print("|---|---|" + "---|" * len(redundant))
    for tokens in (128, 2048, 8192):
        traffic, _ = zipf_loads(rng, tokens, s=args.zipf, order=order)
        before = eplb.identity_placement(L_300B, E_300B, 8)
        cells = [f"{moe_seconds(before.device_load(traffic), before.slots_per_device) * 1e3:.2f} ms"]
        for R in redundant:
            p = eplb.plan(measured, R, 8)
            cells.append(f"{moe_seconds(p.device_load(traffic), p.slots_per_device) * 1e3:.2f} ms")
        print(f"| {tokens} | " + " | ".join(cells) + " |")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("eplb", help="expert-parallel balancedness with redundant experts (EPLB placement)")
    p.add_argument("--loads", default="benchmarks/results/embedded_eval.json",
                   help="a JSON with expert_load [.., L, E] (train.evaluate's); '' to skip")
    p.add_argument("--devices", type=int, default=8, help="EP devices for the loads of --loads")
    p.add_argument("--redundant", default="0,8,16", help="redundant slots R to place (multiples of the EP size; "
                   "0: re-packing only)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per window of the synthetic router")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)
