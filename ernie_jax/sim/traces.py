"""Synthetic request traces for the PD simulator: Poisson arrivals with ShareGPT-like length mixes, given as
distribution parameters (no data download).

Lengths are log-normal (median, sigma), clipped, then multiplied by `scale` (the CPU model runs the same
shapes at a fraction of the length):
- prompt-heavy: prompts median 3,000 tokens, outputs median 64 (summarisation, RAG);
- decode-heavy: prompts median 200, outputs median 800 (long generation, reasoning);
- mixed: prompts median 400 with a long tail (sigma 1.0), outputs median 250 (ShareGPT-like chat);
- sharegpt: the lengths FastDeploy's benchmarks report for ShareGPT, mean input about 1,100 tokens and mean
  output about 200 (log-normal: median 667, sigma 1.0; median 145, sigma 0.8), generated, not downloaded;
- shifting: four phases that alternate prompt-heavy and decode-heavy, each opening with a burst at three
  times the mean rate (the load a fixed split serves worst); `phase_seconds` makes each phase that long
  (minutes, as real load shifts) instead of a quarter of the requests.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# name -> ((prompt median, sigma, min, max), (output median, sigma, min, max))
MIXES = {
    "prompt-heavy": ((3000, 0.5, 64, 12000), (64, 0.5, 4, 512)),
    "decode-heavy": ((200, 0.6, 16, 2000), (800, 0.5, 32, 3000)),
    "mixed": ((400, 1.0, 8, 8000), (250, 0.8, 4, 2000)),
    "sharegpt": ((667, 1.0, 4, 16000), (145, 0.8, 1, 4000)),
}
TRACES = ("prompt-heavy", "decode-heavy", "mixed", "sharegpt", "shifting")


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the trace's start
    prompt_len: int
    output_len: int
    prefix: list[int] | None = None  # shared leading token ids (prefix caching), or None


def _lengths(rng, spec, n: int, scale: float, cap: int) -> np.ndarray:
    median, sigma, lo, hi = spec
    x = np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi) * scale
    return np.clip(np.round(x), 1, cap).astype(int)


def make_trace(name: str, rate: float, num_requests: int, *, seed: int = 0, scale: float = 1.0,
               max_model_len: int = 16384, phase_seconds: float | None = None) -> list[TraceRequest]:
    """num_requests requests arriving at `rate` per second on average; prompt + output <= max_model_len.
    shifting with phase_seconds: four phases of rate x phase_seconds requests each (num_requests ignored)."""
    if name not in TRACES:
        raise ValueError(f"trace {name!r}: expected one of {TRACES}")
    rng = np.random.default_rng(seed)
    if name == "shifting":
        phases, out = 4, []
        if phase_seconds is not None:
            num_requests = phases * max(1, round(rate * phase_seconds))
        per = num_requests // phases
        t = 0.0
        for p in range(phases):
            mix = MIXES["prompt-heavy" if p % 2 == 0 else "decode-heavy"]
            n = per if p < phases - 1 else num_requests - per * (phases - 1)
            burst = n // 3  # a third of the phase's requests arrive at 3x the rate
            gaps = np.concatenate([rng.exponential(1 / (3 * rate), burst), rng.exponential(1 / (rate * 2 / 3), n - burst)])
            out += _requests(rng, mix, t + np.cumsum(gaps), scale, max_model_len)
            t = out[-1].arrival
        return out
    arrivals = np.cumsum(rng.exponential(1 / rate, num_requests))
    return _requests(rng, MIXES[name], arrivals, scale, max_model_len)


def _requests(rng, mix, arrivals, scale, max_model_len) -> list[TraceRequest]:
    n = len(arrivals)
    prompts = _lengths(rng, mix[0], n, scale, max_model_len // 2)
    outputs = _lengths(rng, mix[1], n, scale, max_model_len // 2)
    return [TraceRequest(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]
