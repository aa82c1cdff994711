"""`EngineStats`: an immutable snapshot of an engine's state for metrics and health. The engine takes one under
its lock after every step and whenever a request is queued, aborted or failed, and publishes it whole, so a
reader on another thread (the server's /metrics) never sees a half-applied step and never takes the lock: a
request counts as running until the engine has recorded its end (counted it, forgotten it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ernie_jax.engine.policy import InstanceView


@dataclasses.dataclass(frozen=True)
class PoolStats:
    usage: float  # fraction of pages held by requests
    cached_free: float  # fraction of pages free but holding a cached prefix
    free: int
    capacity: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int  # admitted, moving between instances, or ended and not yet recorded
    num_waiting: int
    pools: dict[str, PoolStats]  # by instance
    counters: dict[str, int]  # num_preemptions, prefix_queries, prefix_hits, prefill_tokens (over instances)
    busy_seconds: dict[str, dict[str, float]]  # instance -> program -> seconds from dispatch to result
    steps: dict[str, dict[str, int]]  # instance -> program -> steps completed
    expert_tokens: np.ndarray  # [L_moe, E] tokens routed to each expert, over instances
    moe_layers: list[int]  # the model layer of each row of expert_tokens
    ops: list[dict[str, str]]  # per op: the implementation the programs run, and why others were not
    role_switches: dict[tuple[str, str, str], int]  # (instance, from, to) -> count (PD)
    pd_requests: dict[tuple[str, str], int]  # finished requests by (prefilled on, decoded on)
    kv_transfer: tuple[float, int] | None  # PD: (seconds, bytes) moved prefill -> decode
    spec_decode: dict[str, Any] | None  # speculative decoding counters (SpecDecodeStats.report)
    eplb: dict[str, Any] | None  # {"balancedness": per MoE layer, "rebalances": n}
    views: dict[str, InstanceView]  # what the PD policy sees of each instance (a router's policy too)
    # structured output: grammars compiled per COMPILE_BUCKETS bucket, their seconds, token-mask seconds and the
    # steps that computed masks (None without a tokenizer)
    structured: dict[str, Any] | None = None


COUNTERS = ("num_preemptions", "prefix_queries", "prefix_hits", "prefill_tokens")


def snapshot(engine) -> EngineStats:
    """The engine's stats now; the caller holds the engine's lock."""
    insts = engine.instances
    pools = {i.name: PoolStats(i.pool.usage, i.pool.cached_free / i.pool.capacity, i.pool.free, i.pool.capacity)
             for i in insts}
    transfer = insts[0].transfer if len(insts) > 1 else None
    balancer = engine.balancer
    return EngineStats(len(engine.requests) - len(engine.waiting), len(engine.waiting), pools,
                       {c: sum(getattr(i.scheduler, c) for i in insts) for c in COUNTERS},
                       {i.name: dict(i.runner.busy_seconds) for i in insts},
                       {i.name: dict(i.runner.steps) for i in insts},
                       sum(i.runner.expert_tokens for i in insts).copy(), list(engine.moe_layers),
                       engine.compile_report.ops, dict(engine.role_switches), dict(engine.pd_requests),
                       (transfer.seconds, transfer.bytes) if transfer is not None else None,
                       engine.spec_stats.report() if engine.speculative else None,
                       {"balancedness": list(balancer.current_balancedness()), "rebalances": balancer.rebalances}
                       if balancer is not None else None, {i.name: i.view() for i in insts},
                       None if engine.guides is None else {
                           "compile_counts": list(engine.guides.compile_counts),
                           "compile_seconds": engine.guides.compile_seconds,
                           "mask_seconds": sum(i.runner.mask_seconds for i in insts),
                           "masked_steps": sum(i.runner.masked_steps for i in insts)})
