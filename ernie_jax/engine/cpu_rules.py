"""The rules that exist only because XLA:CPU is the test bed: one place, read by the runner side of the
engine (programs, pool layout) and never by the model math.

- `min_decode_rows`: a lone sequence decodes beside a padding row when a plain bf16 matmul is involved;
- `cpu_expert_groups`: how many groups an unsharded model's routed experts are split into
  (model/weights.cpu_layout lays the weights out per group);
- `kernel_parallel_work`: the smallest CPU kernel call that XLA's pool threads share (ops/cpu_kernels).
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp

from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.model.weights import QUANTIZABLE
from ernie_jax.quant import IntWeight, is_quantized


def platform(model: ErnieForCausalLM) -> str:
    """The platform ("cpu", "gpu", "tpu") the model's weights live on."""
    return next(iter(jax.tree.leaves(model.weights())[0].devices())).platform


def min_decode_rows(model: ErnieForCausalLM) -> int:
    """2 on CPU for a model with a plain bf16 matmul (a linear, or the LM head: the tied embedding of an FP8
    release is bf16), else 1. XLA:CPU runs a one-row bf16 matmul (a matrix-vector product) through a fallback
    that converts the weight to f32 on every call (a two-row step is ten times faster than a one-row one:
    benchmarks/RESULTS.md, "CPU measurements behind design choices"), so there a lone sequence decodes
    beside a padding row. Block-FP8 and f32
    linears do not take that fallback; integer weights are multiplied in the activation dtype, so a bf16
    model's take it like plain bf16 ones."""
    if platform(model) != "cpu":
        return 1
    w = model.weights()
    head = w["lm_head"] if w.get("lm_head") is not None else w["embed"]
    plain_bf16 = [a for seg in w["segments"] for name, a in seg.items()
                  if name in QUANTIZABLE and (isinstance(a, IntWeight) and model.dtype == jnp.bfloat16
                                               or not is_quantized(a) and a.dtype == jnp.bfloat16)]
    return 2 if plain_bf16 or head.dtype == jnp.bfloat16 else 1


def cpu_expert_groups(num_experts: int) -> int:
    """How many groups an unsharded CPU model's routed experts are split into (weights.cpu_layout): one per
    core XLA:CPU runs on, the largest divisor of num_experts that is not above the core count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(g for g in range(1, max(1, min(cores, num_experts)) + 1) if num_experts % g == 0)



# Where a model's weights fit in the last-level cache and the host prepares each decode step while the one
# before runs, a kernel call below this many multiply-adds runs on one thread: its weights stream from cache
# faster than a helper wakes, and a helper takes the core the host needs (benchmarks/RESULTS.md, "Compiled
# CPU kernels"). A small model's LM head and its batched calls stay above it.
CACHED_PARALLEL_WORK = 1 << 20


def last_level_cache_bytes() -> int:
    """The largest CPU cache this process's first CPU reports (Linux sysfs), or 0 where none is reported."""
    sizes = []
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size or 0))
    return max(sizes, default=0)


def kernel_parallel_work(weights, decode_steps: int = 1) -> int:
    """The multiply-adds below which a CPU kernel call runs on its calling thread alone (cpu_kernels.
    set_parallel_work), for the weights (a pytree) as the programs read them: CACHED_PARALLEL_WORK where they
    fit in the last-level cache and decode runs one step a program; else 0, every call with two units of work
    sharing them (from memory a second core's bandwidth pays even for a small call, and a multi-step program
    runs while the host waits). Only a speed setting: a kernel's results never depend on its threads."""
    weights = sum(a.nbytes for a in jax.tree.leaves(weights))
    cache = last_level_cache_bytes()
    return CACHED_PARALLEL_WORK if cache and weights <= cache and decode_steps == 1 else 0
