"""`EngineConfig`: every engine setting in one frozen, typed object, built once (from `LLM(...)` keyword
arguments or the server's flags) and passed whole. Names follow vLLM's (`max_num_batched_tokens`,
`block_size`, `num_gpu_blocks_override`, `gpu_memory_utilization`, ...); the parts group them as vLLM's
VllmConfig does: how the weights load, the KV cache, the scheduler, the devices and PD, speculative
decoding and EPLB. `summary()` is what start-up logs and `/v1/models` show.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ernie_jax.engine.expert_balance import EPLBConfig
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.engine.speculative import SpeculativeConfig
from ernie_jax.quant import check_scheme

DTYPES = ("bfloat16", "bf16", "float32", "fp32")
KERNELS = ("auto", "pallas", "xla")
SHARDINGS = ("tp_ep", "tp", "dp_attn_ep")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """How the weights are read, placed and compiled."""
    dtype: str = "bfloat16"  # the activations' and unquantized weights' dtype
    quantization: str | None = None  # quantize a BF16 checkpoint at load: "fp8", "wint8", "wint4" or "w4a8"
    fp8_compute: str = "w8a8"  # block-FP8 linears: "w8a8" (FP8 activations) or "weight_only"
    quant_group_size: int = -1  # wint4's scales: -1 per output channel (FastDeploy's), or a group along `in`
    seed: int = 0  # random weights of a preset, and the seeds of unseeded requests
    kernels: str = "auto"  # ops/execution.py: "auto", "pallas" or "xla"
    compilation_cache_dir: str | None = "~/.cache/ernie_jax/xla"  # JAX's persistent cache (None: off)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV page
    num_gpu_blocks_override: int | None = None  # KV pages per pool (each instance's)
    gpu_memory_utilization: float | None = None  # fraction of device memory for weights and KV (None: 0.9)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "bfloat16" or "fp8"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8  # sequences decoded together
    max_model_len: int | None = None  # prompt + output tokens (None: min(the model's, 2048))
    max_num_batched_tokens: int = 512  # prompt tokens per step: a long prompt's chunk, short ones' batch
    batch_invariant: bool = False  # one decode shape: a request's tokens never depend on its batch
    background_compile: bool = False  # ready once the largest buckets compiled; the rest compile behind
    # decode steps one program runs while nothing else waits (multi-step decode; 1: off; MTP: 1)
    num_scheduler_steps: int = 1


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    mesh: int | str | None = None  # None: one device; else a device count or axis sizes
    prefill_devices: int | None = None  # devices of the prefill submesh under PD (None: half)
    disaggregate: bool = True  # with a mesh: prefill and decode on disjoint submeshes
    sharding: str = "tp_ep"  # sharding/rules.py: "tp_ep", "tp" or "dp_attn_ep"
    pd_policy: PDPolicy = PDPolicy()  # engine/policy.py: role switching ("dynamic") or fixed roles


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = LoadConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    eplb: EPLBConfig | None = None

    @classmethod
    def create(cls, **settings: Any) -> "EngineConfig":
        """From flat keyword arguments with vLLM's names (the fields of the parts, plus pd_policy as "static",
        "dynamic" or a PDPolicy, speculative_config and eplb_config as a dict, JSON text or config).
        Raises ValueError naming the setting for an unknown name or a bad value."""
        speculative = SpeculativeConfig.parse(settings.pop("speculative_config", None))
        eplb = EPLBConfig.parse(settings.pop("eplb_config", None))
        policy = settings.pop("pd_policy", "dynamic")
        if not isinstance(policy, PDPolicy):
            policy = PDPolicy(policy)
        parts = {}
        for name, part in (("load", LoadConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                           ("parallel", ParallelConfig)):
            fields = {f.name for f in dataclasses.fields(part)}
            parts[name] = part(**{k: settings.pop(k) for k in list(settings) if k in fields})
        if settings:
            known = sorted(f.name for p in parts.values() for f in dataclasses.fields(p)) + \
                ["eplb_config", "speculative_config"]
            raise ValueError(f"unknown engine setting(s) {sorted(settings)}; known: {known}")
        parts["parallel"] = dataclasses.replace(parts["parallel"], pd_policy=policy)
        config = cls(**parts, speculative=speculative, eplb=eplb)
        config.check()
        return config

    def check(self) -> None:
        """Raise ValueError naming the first setting out of range."""
        s, c, load = self.scheduler, self.cache, self.load
        if load.dtype not in DTYPES:
            raise ValueError(f"dtype {load.dtype!r} is not one of {list(DTYPES)}")
        check_scheme(load.quantization, load.quant_group_size)
        if load.kernels not in KERNELS:
            raise ValueError(f"kernels {load.kernels!r} is not one of {list(KERNELS)}")
        if self.parallel.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.parallel.sharding!r} is not one of {list(SHARDINGS)}")
        for name, value in (("max_num_seqs", s.max_num_seqs), ("max_num_batched_tokens", s.max_num_batched_tokens),
                            ("block_size", c.block_size), ("num_scheduler_steps", s.num_scheduler_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if c.num_gpu_blocks_override is not None and c.num_gpu_blocks_override < 2:
            raise ValueError(f"num_gpu_blocks_override={c.num_gpu_blocks_override}: a KV pool needs at least 2 "
                             "pages (one is the null page)")
        if c.gpu_memory_utilization is not None and not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")

    def with_max_model_len(self, max_model_len: int) -> "EngineConfig":
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len))

    def summary(self) -> dict[str, Any]:
        """The settings as one flat dict of plain values (logs, /v1/models)."""
        out: dict[str, Any] = {}
        for part in (self.load, self.cache, self.scheduler, self.parallel):
            for f in dataclasses.fields(part):
                value = getattr(part, f.name)
                out[f.name] = value.mode if isinstance(value, PDPolicy) else value
        out["speculative_config"] = dataclasses.asdict(self.speculative) if self.speculative else None
        out["eplb_config"] = dataclasses.asdict(self.eplb) if self.eplb else None
        return out
