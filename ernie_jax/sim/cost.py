"""Cost models for the PD simulator: seconds per prefill step, decode step and KV transfer, and KV pages per
instance, as functions of what the step runs and how many devices the instance has.

`FittedCost`: fitted to the real engine's measured steps (its instances' StepRecords; sim/calibrate.py
runs the engine and fits), per instance size: a step alone costs a constant plus terms linear in its
padded prefill tokens, prefill tokens x context, decode batch rows and decode context; while the other
instance runs a step it runs (1 + contention[kind of that step]) times slower, because on a CPU test bed the
two instances share the host's cores (fitted from how much of each step the other instance's steps
overlapped; non-negative least squares). A hand-over costs its measured seconds per KV
token.

`H200Cost`: ERNIE-4.5-300B-A47B-FP8 on H200s, from H200 roofline figures (per device: 141 GB of
HBM3e at 4.8 TB/s, 1,979 dense FP8 TFLOP/s; model sizes from docs/model.md §7). Assumptions, all parameters of the dataclass:
- decode step = weight bytes read (dense 10.3 GB + lm_head 1.7 GB, plus the distinct experts the batch
  touches, 64 (1 - (7/8)^B) per layer of 88.1 MB, over 51 layers) + KV bytes (110,592 per token of
  context) at `hbm_efficiency` of 4.8 TB/s per device, plus 94.1 GFLOP per row at `decode_flops_efficiency`
  of 1,979 TFLOP/s (FP8), plus `step_overhead` (launches and the collectives of 54 layers);
- prefill step = 94.1 GFLOP per (padded) token + attention 4 x context x 8192 x 54 FLOP per token at
  `prefill_mfu` (BF16 attention counted at FP8 rate x 0.5), never faster than reading the weights once;
- transfer = 110,592 B per token at `transfer_bandwidth` (bytes/s, the whole sending submesh);
- pages: `hbm_fraction` of 141 GB per device minus the 301 GB of weights, in FP8 KV pages.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol, Sequence

import numpy as np


class CostModel(Protocol):
    name: str
    ttft_slo: float
    tpot_slo: float

    def step(self, tokens: int, shape: tuple[int, int], context: int, rows: int, batch: int, decode_context: int,
             devices: int) -> float:
        """Seconds of one instance step that runs a prefill program of `tokens` real prompt tokens (a
        (B, T) `shape` program, its rows attending over `context` positions in all) and a decode program of
        `rows` sequences (a `batch`-row program, `decode_context` tokens of context in all); either part may
        be absent (0): the fields of a StepRecord."""

    def transfer(self, tokens: int, devices: int) -> float: ...

    def pages(self, devices: int, page_size: int) -> int: ...

    # How much slower a step runs while the other instance runs a step of that kind ("prefill": one with a
    # prefill program, "decode": one without), as a fraction: 0 where instances share nothing.
    contention: dict[str, float]


@dataclasses.dataclass(frozen=True)
class H200Cost:
    name: str = "8xH200, ERNIE-4.5-300B-A47B-FP8"
    ttft_slo: float = 2.0
    tpot_slo: float = 0.050
    hbm_bandwidth: float = 4.8e12  # bytes/s per device
    hbm_efficiency: float = 0.85
    fp8_flops: float = 1.979e15  # dense, per device
    decode_flops_efficiency: float = 0.5
    prefill_mfu: float = 0.4
    step_overhead: float = 2e-3  # seconds per step: launches + ~108 collectives at 10-20 us
    transfer_bandwidth: float = 200e9  # bytes/s between submeshes (NVLink, achieved)
    hbm_per_device: float = 141e9
    hbm_fraction: float = 0.9
    weight_bytes: float = 301e9
    kv_bytes_per_token: float = 110_592
    flops_per_token: float = 2 * 47.05e9
    # The deployment it describes by default: SimConfig fields and the trace length scale.
    settings: dict = dataclasses.field(default_factory=lambda: dict(
        max_num_seqs=128, max_num_batched_tokens=2048, block_size=64, max_model_len=16384, min_decode_rows=1, scale=1.0))
    # Submeshes share no devices; the host threads' share of a step is inside step_overhead.
    contention: dict = dataclasses.field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})

    def _bandwidth(self, devices: int) -> float:
        return devices * self.hbm_bandwidth * self.hbm_efficiency

    def step(self, tokens, shape, context, rows, batch, decode_context, devices) -> float:
        seconds, padded = 0.0, shape[0] * shape[1]
        if rows:
            experts = 64 * (1 - (7 / 8) ** rows)
            weights = 12.0e9 + 51 * experts * 88.1e6
            memory = (weights + decode_context * self.kv_bytes_per_token) / self._bandwidth(devices)
            compute = rows * self.flops_per_token / (devices * self.fp8_flops * self.decode_flops_efficiency)
            seconds += memory + compute + self.step_overhead
        if tokens:
            linear = padded * self.flops_per_token / (devices * self.fp8_flops * self.prefill_mfu)
            mean_context = context / tokens / 2  # a chunk's tokens attend to half its span on average
            attention = tokens * 4 * mean_context * 8192 * 54 / (devices * self.fp8_flops * 0.5 * self.prefill_mfu)
            seconds += max(linear + attention, self.weight_bytes / self._bandwidth(devices)) + self.step_overhead
        return seconds

    def transfer(self, tokens: int, devices: int) -> float:
        return tokens * self.kv_bytes_per_token / self.transfer_bandwidth

    def pages(self, devices: int, page_size: int) -> int:
        room = devices * self.hbm_per_device * self.hbm_fraction - self.weight_bytes
        if room <= 0:
            raise ValueError(f"{devices} devices of {self.hbm_per_device / 1e9:.0f} GB cannot hold the "
                             f"{self.weight_bytes / 1e9:.0f} GB of FP8 weights")
        return int(room // (page_size * self.kv_bytes_per_token)) + 1


def h800_cost() -> H200Cost:
    """The same model on H800 nodes: 80 GB of HBM3 a device at 3.35 TB/s, the H100's 1,979 dense FP8 TFLOP/s,
    one instance a node of 8 (300B-FP8 needs a whole node), KV between nodes over RDMA: 8 x 400 Gb/s NICs,
    400 GB/s a node, half of it achieved (an assumption, like every figure of the H200 model)."""
    return H200Cost(name="H800 nodes of 8, ERNIE-4.5-300B-A47B-FP8", hbm_bandwidth=3.35e12, hbm_per_device=80e9,
                    transfer_bandwidth=200e9)


COSTS = {"h200": H200Cost, "h800": h800_cost}


_TERMS = ("prefill step", "padded prefill token", "prefill token x context", "decode step", "decode row",
          "decode context token")


def _features(tokens, shape, context, rows, batch, decode_context) -> list[float]:
    (B, T) = shape  # each of a row's T query positions attends to up to its context: T x context, in thousands
    return [float(tokens > 0), float(B * T), T * context / 1e3, float(rows > 0), float(batch), float(decode_context)]


def step_kind(prefill_tokens: int) -> str:
    """A step's kind for contention: "prefill" when it runs a prefill program."""
    return "prefill" if prefill_tokens else "decode"


def _overlaps(steps: Sequence, peers: Sequence) -> np.ndarray:
    """[n, 2]: the fraction of each step's time during which a peer ran a prefill step, a decode step."""
    out = np.zeros((len(steps), 2))
    if not steps or not peers:
        return out
    t = np.asarray([(s.t0, s.t1) for s in steps])
    for k, kind in enumerate(("prefill", "decode")):
        p = np.asarray([(s.t0, s.t1) for s in peers if step_kind(s.prefill_tokens) == kind]).reshape(-1, 2)
        if len(p):
            shared = np.clip(np.minimum(t[:, None, 1], p[None, :, 1]) - np.maximum(t[:, None, 0], p[None, :, 0]), 0, None)
            out[:, k] = shared.sum(1) / np.maximum(t[:, 1] - t[:, 0], 1e-9)
    return np.minimum(out, 1.0)


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative term and refit until none is."""
    keep = [j for j in range(X.shape[1]) if X[:, j].any()]
    while True:
        coef = np.zeros(X.shape[1])
        coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep.remove(int(np.argmin(coef)))


def _fit(X: np.ndarray, y: np.ndarray, overlap: np.ndarray, sizes: np.ndarray) -> tuple[dict, tuple[float, float]]:
    """Per-size coefficients and one (prefill, decode) contention pair minimising the squared error of
    y ~ (X @ coef[size]) * (1 + overlap @ contention), by a coarse-to-fine grid over the contention pair.
    Squared seconds, not relative error: what the simulator must get right is mean step time (a TPOT is a
    mean over a request's steps), and step times vary well beyond what their shapes explain."""
    def solve(kp: float, kd: float):
        Xs = X * (1 + overlap @ np.asarray([kp, kd]))[:, None]
        coefs, err = {}, 0.0
        for size in np.unique(sizes):
            m = sizes == size
            coefs[int(size)] = c = _nnls(Xs[m], y[m])
            err += float(np.sum((Xs[m] @ c - y[m]) ** 2))
        return err, coefs
    if not overlap.any():  # no instance ran beside another
        return solve(0.0, 0.0)[1], (0.0, 0.0)
    best, step = (0.0, 0.0), 0.5
    for _ in range(3):
        grid = [(max(0.0, best[0] + i * step), max(0.0, best[1] + j * step)) for i in range(-4, 9) for j in range(-4, 9)]
        best = min(set(grid), key=lambda kk: solve(*kk)[0])
        step /= 5
    return solve(*best)[1], best


@dataclasses.dataclass(frozen=True)
class FittedCost:
    name: str
    ttft_slo: float
    tpot_slo: float
    coefficients: dict[int, list[float]]  # instance devices -> seconds per _TERMS, the step alone
    contention: dict[str, float]  # see CostModel.contention
    transfer_per_token: float  # seconds per KV token handed over
    num_pages: dict[int, int]  # instance devices -> KV pages of its pool
    settings: dict  # the engine's: SimConfig fields (max_num_seqs, max_num_batched_tokens, block_size, ...), trace scale

    @classmethod
    def fit(cls, timelines: dict[int, Sequence[Sequence]], *, transfer_seconds: float, transfer_tokens: int,
            num_pages: dict[int, int], settings: dict, name: str, ttft_slo: float, tpot_slo: float) -> "FittedCost":
        """timelines: instance devices -> the StepRecords of each instance of that size that served together
        (one instance: colocated; two: a PD pair, each the other's peer)."""
        X, y, overlap, sizes = [], [], [], []
        for devices, group in timelines.items():
            for k, steps in enumerate(group):
                peers = [s for j, other in enumerate(group) if j != k for s in other]
                for s, o in zip(steps, _overlaps(steps, peers)):
                    if s.t1 - s.t0 - s.transfer_seconds > 0:
                        X.append(_features(*s[2:8]))
                        y.append(s.t1 - s.t0 - s.transfer_seconds)
                        overlap.append(o)
                        sizes.append(devices)
        sizes = np.asarray(sizes)
        for devices in timelines:
            if (sizes == devices).sum() < len(_TERMS):
                raise ValueError(f"{(sizes == devices).sum()} measured steps on {devices}-device instances: too "
                                 "few to fit")
        coefs, (kp, kd) = _fit(np.asarray(X), np.asarray(y), np.asarray(overlap), sizes)
        return cls(name, ttft_slo, tpot_slo, {d: c.tolist() for d, c in coefs.items()},
                   {"prefill": kp, "decode": kd}, transfer_seconds / max(1, transfer_tokens), dict(num_pages),
                   dict(settings))

    def _coef(self, devices: int) -> list[float]:
        if devices not in self.coefficients:
            raise ValueError(f"the cost model {self.name!r} was fitted on instances of {sorted(self.coefficients)} "
                             f"devices, not {devices}")
        return self.coefficients[devices]

    def step(self, tokens, shape, context, rows, batch, decode_context, devices) -> float:
        x = _features(tokens, shape, context, rows, batch, decode_context)
        return float(np.dot(self._coef(devices), x))

    def transfer(self, tokens: int, devices: int) -> float:
        return tokens * self.transfer_per_token

    def pages(self, devices: int, page_size: int) -> int:
        self._coef(devices)
        if page_size != self.settings["block_size"]:
            raise ValueError(f"the cost model {self.name!r} was measured with page size "
                             f"{self.settings['block_size']}, not {page_size}")
        return self.num_pages[devices]

    def describe(self) -> str:
        return "; ".join(f"{d} devices: " + ", ".join(f"{t} {c * 1e3:.3g} ms" for t, c in zip(_TERMS, cs) if c)
                         for d, cs in sorted(self.coefficients.items())) + \
            "; beside a prefill step x{:.2f}, beside a decode step x{:.2f}".format(
                1 + self.contention["prefill"], 1 + self.contention["decode"])

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "FittedCost":
        with open(path) as f:
            d = json.load(f)
        missing = {f.name for f in dataclasses.fields(cls)} - set(d)
        if missing:
            raise ValueError(f"{path}: not a fitted cost model (missing {sorted(missing)})")
        d["coefficients"] = {int(k): v for k, v in d["coefficients"].items()}
        d["num_pages"] = {int(k): v for k, v in d["num_pages"].items()}
        return cls(**d)


def feasible_splits(cost: CostModel, devices: int, page_size: int) -> list[int]:
    """Prefill device counts whose two submeshes the cost model can serve (H200: both hold the weights)."""
    out = []
    for k in range(1, devices):
        try:
            cost.pages(k, page_size), cost.pages(devices - k, page_size)
        except ValueError:
            continue
        out.append(k)
    return out
