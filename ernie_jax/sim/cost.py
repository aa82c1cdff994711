"""Cost models for the PD simulator: seconds per prefill step, decode step and KV transfer, and KV pages per
instance, as functions of what the step runs and how many devices the instance has.

`H200Cost`: ERNIE-4.5-300B-A47B-FP8 on H200s, from the roofline figures of shared/docs/PERFORMANCE.md
(section 3). Assumptions, all parameters of the dataclass:
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
from typing import Protocol


class CostModel(Protocol):
    name: str
    ttft_slo: float
    tpot_slo: float

    def step(self, tokens: int, padded: int, context: int, rows: int, batch: int, decode_context: int,
             devices: int) -> float:
        """Seconds of one instance step that runs a prefill program of `tokens` real prompt tokens (`padded`
        with padding, attending over `context` positions in all) and a decode program of `rows` sequences
        (a `batch`-row program, `decode_context` tokens of context in all); either part may be absent (0)."""

    def transfer(self, tokens: int, devices: int) -> float: ...

    def pages(self, devices: int, page_size: int) -> int: ...


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

    def _bandwidth(self, devices: int) -> float:
        return devices * self.hbm_bandwidth * self.hbm_efficiency

    def step(self, tokens, padded, context, rows, batch, decode_context, devices) -> float:
        seconds = 0.0
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
            raise ValueError(f"{devices} H200s cannot hold the 301 GB of FP8 weights")
        return int(room // (page_size * self.kv_bytes_per_token)) + 1
