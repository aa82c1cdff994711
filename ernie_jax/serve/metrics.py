"""Prometheus metrics of the server (`GET /metrics`), named like vLLM's with an `ernie_jax:` prefix.

Per-request histograms (TTFT, TPOT, end-to-end, queue time) and outcome counters are observed when a
request finishes (on the engine thread) or is rejected (on the HTTP side). Engine state -- running and
waiting requests, KV-cache usage per pool, tokens routed to each expert of each MoE layer, each
instance's busy seconds and steps, KV transfer totals, PD role switches and
where requests were prefilled and decoded, EPLB balancedness, speculative decoding counters -- is read at scrape time by a collector, so it costs nothing
between scrapes. Each server has its own registry (several can live in one process, e.g. in tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from typing import Callable

from ernie_jax.engine.request import Request
from ernie_jax.engine.stats import EngineStats
from ernie_jax.structured.guide import COMPILE_BUCKETS

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_OUTCOME = {400: "rejected_invalid", 401: "rejected_unauthorized", 404: "rejected_invalid", 413: "rejected_invalid",
            429: "rejected_busy"}


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        """stats: the engine client's stats(), read at each scrape."""
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self.requests = Counter("ernie_jax:requests", "Requests by outcome: the finish reason (stop, length, "
                                "abort) or the rejection (rejected_invalid, rejected_busy, error)",
                                ["model_name", "outcome"], registry=r)
        hist = lambda name, doc, buckets: Histogram(  # noqa: E731
            name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)
        self.ttft = hist("ernie_jax:time_to_first_token_seconds", "Arrival to first token", _LATENCY)
        self.tpot = hist("ernie_jax:time_per_output_token_seconds", "Mean gap between output tokens", _TPOT)
        self.e2e = hist("ernie_jax:e2e_request_latency_seconds", "Arrival to finish", _LATENCY)
        self.queue = hist("ernie_jax:request_queue_time_seconds", "Arrival to admission (pages reserved)", _LATENCY)
        self.prompt_tokens = Counter("ernie_jax:prompt_tokens", "Prompt tokens of finished requests",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("ernie_jax:generation_tokens", "Generated tokens of finished requests",
                                         ["model_name"], registry=r).labels(**labels)
        self.structured = Counter("ernie_jax:structured_output_requests", "Requests with a structured-output "
                                  "constraint, by kind (json, json_object, regex, choice, grammar, tools)",
                                  ["model_name", "kind"], registry=r)
        self.model_name = model_name
        r.register(_EngineCollector(stats, model_name))

    def on_finish(self, req: Request) -> None:
        m = req.metrics
        self.requests.labels(self.model_name, req.finish_reason).inc()
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.generation_tokens.inc(len(req.output_ids))
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if req.tpot is not None:
            self.tpot.observe(req.tpot)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def rejected(self, status: int) -> None:
        self.requests.labels(self.model_name, _OUTCOME.get(status, "error")).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        stats, name = self.stats(), self.model_name
        g = GaugeMetricFamily("ernie_jax:num_requests_running", "Requests in prefill or decode (or moving between "
                              "the PD instances)", labels=["model_name"])
        g.add_metric([name], stats.num_running)
        yield g
        g = GaugeMetricFamily("ernie_jax:num_requests_waiting", "Requests waiting for KV pages or a batch slot",
                              labels=["model_name"])
        g.add_metric([name], stats.num_waiting)
        yield g
        pools = stats.pools.items()
        g = GaugeMetricFamily("ernie_jax:kv_cache_usage_perc", "Fraction of KV pages held by requests, per pool",
                              labels=["model_name", "pool"])
        for role, pool in pools:
            g.add_metric([name, role], pool.usage)
        yield g
        g = GaugeMetricFamily("ernie_jax:kv_cache_cached_free_perc", "Fraction of KV pages free but holding a "
                              "cached prefix (evicted LRU when the pool needs them), per pool",
                              labels=["model_name", "pool"])
        for role, pool in pools:
            g.add_metric([name, role], pool.cached_free)
        yield g
        for metric, counter, doc in (
                ("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "prefix_hits", "Prompt tokens the prefix cache served"),
                ("num_preemptions", "num_preemptions", "Requests preempted (pages freed, recomputed later)"),
                ("prefill_computed_tokens", "prefill_tokens", "Tokens prefills computed (not served by the cache)")):
            c = CounterMetricFamily(f"ernie_jax:{metric}", doc, labels=["model_name"])
            c.add_metric([name], float(stats.counters[counter]))
            yield c
        info = InfoMetricFamily("ernie_jax:op_implementation", "The implementation each op runs, and why preferred "
                                "ones were not used", labels=["model_name", "op"])
        for op in stats.ops:
            info.add_metric([name, op["op"]], {k: v for k, v in op.items() if k != "op"})
        yield info
        c = CounterMetricFamily("ernie_jax:moe_expert_tokens", "Tokens routed to each expert of each MoE layer",
                                labels=["model_name", "layer", "expert"])
        for row, layer in enumerate(stats.moe_layers):
            for expert, n in enumerate(stats.expert_tokens[row]):
                c.add_metric([name, str(layer), str(expert)], float(n))
        yield c
        c = CounterMetricFamily("ernie_jax:submesh_busy_seconds", "Seconds from dispatch to result of each "
                                "instance's (submesh's) programs", labels=["model_name", "submesh", "program"])
        for inst, programs in stats.busy_seconds.items():
            for program, seconds in programs.items():
                c.add_metric([name, inst, program], seconds)
        yield c
        c = CounterMetricFamily("ernie_jax:submesh_steps", "Steps each instance completed, per program",
                                labels=["model_name", "submesh", "program"])
        for inst, programs in stats.steps.items():
            for program, n in programs.items():
                c.add_metric([name, inst, program], float(n))
        yield c
        if stats.eplb is not None:
            g = GaugeMetricFamily("ernie_jax:eplb_balancedness", "Per MoE layer: mean over max tokens per expert-"
                                  "parallel device of the load window, under the expert placement in force",
                                  labels=["model_name", "layer"])
            for layer, b in zip(stats.moe_layers, stats.eplb["balancedness"]):
                g.add_metric([name, str(layer)], float(b))
            yield g
            c = CounterMetricFamily("ernie_jax:eplb_rebalances", "Expert re-placements applied",
                                    labels=["model_name"])
            c.add_metric([name], float(stats.eplb["rebalances"]))
            yield c
        if stats.structured is not None:
            s = stats.structured
            h = HistogramMetricFamily("ernie_jax:structured_output_compile_seconds", "Seconds compiling a "
                                      "structured-output constraint (once per constraint: compiled ones are cached)",
                                      labels=["model_name"])
            cumulative = [sum(s["compile_counts"][:k + 1]) for k in range(len(COMPILE_BUCKETS) + 1)]
            h.add_metric([name], [(str(b), float(n)) for b, n in zip(COMPILE_BUCKETS, cumulative)] +
                         [("+Inf", float(cumulative[-1]))], s["compile_seconds"])
            yield h
            c = CounterMetricFamily("ernie_jax:structured_output_mask_seconds", "Host seconds computing the token "
                                    "masks of constrained requests (overlapped with the device's forward pass)",
                                    labels=["model_name"])
            c.add_metric([name], s["mask_seconds"])
            yield c
            c = CounterMetricFamily("ernie_jax:structured_output_masked_steps", "Program steps that sampled with "
                                    "token masks", labels=["model_name"])
            c.add_metric([name], float(s["masked_steps"]))
            yield c
        if stats.spec_decode is not None:  # vLLM's spec-decode counters
            spec = stats.spec_decode
            for metric, value, doc in (
                    ("num_drafts", spec["num_drafts"], "Draft proposals verified (one per request per decode step)"),
                    ("num_draft_tokens", spec["num_draft_tokens"], "Draft tokens verified"),
                    ("num_accepted_tokens", spec["num_accepted_tokens"], "Draft tokens accepted")):
                c = CounterMetricFamily(f"ernie_jax:spec_decode_{metric}", doc, labels=["model_name"])
                c.add_metric([name], float(value))
                yield c
            c = CounterMetricFamily("ernie_jax:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                    "each draft position", labels=["model_name", "position"])
            for position, n in enumerate(spec["accepted_per_position"]):
                c.add_metric([name, str(position)], float(n))
            yield c
        if stats.kv_transfer is not None:
            seconds, moved = stats.kv_transfer
            c = CounterMetricFamily("ernie_jax:kv_transfer_seconds", "Time moving KV pages prefill -> decode",
                                    labels=["model_name"])
            c.add_metric([name], seconds)
            yield c
            c = CounterMetricFamily("ernie_jax:kv_transfer_bytes", "KV bytes moved prefill -> decode",
                                    labels=["model_name"])
            c.add_metric([name], float(moved))
            yield c
            c = CounterMetricFamily("ernie_jax:pd_role_switches", "Times an instance started (to) or stopped "
                                    "(back to its home role) doing the other role's work",
                                    labels=["model_name", "submesh", "from", "to"])
            for (inst, src, dst), n in sorted(stats.role_switches.items()):
                c.add_metric([name, inst, src, dst], float(n))
            yield c
            c = CounterMetricFamily("ernie_jax:pd_requests", "Finished requests by the instance that prefilled "
                                    "them and the one that decoded them", labels=["model_name", "prefill", "decode"])
            for (p, d), n in sorted(stats.pd_requests.items()):
                c.add_metric([name, p, d], float(n))
            yield c
