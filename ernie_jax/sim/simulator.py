"""The discrete-event PD simulator: the engine's own instance step boundary, scheduler, page pools and PD
policy, with a cost model in place of the devices and a virtual clock in place of time.

`SimInstance` is an `engine.instance.Instance` whose dispatch and read are replaced: a step "runs" for
the cost model's time of what it dispatched (the shape the real instance would run: bucketed prefill
(B, T), decode batch, contexts), every decoding row gets one token, a finished prompt its first token.
Hand-overs cost the sender the transfer time of the request's pages, and the request reaches the receiver
once that time has passed. Two steps running at once share the
machine as the cost model's `contention` says (processor sharing: each progresses at 1 / (1 + the
contention of the other's kind); hand-over times are not shared, being measured as they ran). Everything else (admission with its
bypass rule, pages on demand, preemption, prefix caching, hand-over and role-switching decisions) is the
engine's code. Requests end by length only (the trace fixes output lengths).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading

import numpy as np

from ernie_jax.engine.instance import Instance
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.engine.programs import buckets, decode_buckets, prefill_shapes
from ernie_jax.engine.request import Request, RequestMetrics
from ernie_jax.sampling import SamplingParams
from ernie_jax.sim.cost import CostModel, step_kind
from ernie_jax.sim.traces import TraceRequest


@dataclasses.dataclass
class SimConfig:
    """One simulated deployment: colocated on all devices, or PD with `prefill_devices` of them."""
    mode: str  # "colocated", "static" or "dynamic"
    devices: int
    prefill_devices: int = 0  # PD only
    max_num_seqs: int = 64
    prefill_chunk: int = 2048
    page_size: int = 64
    max_model_len: int = 16384
    enable_prefix_caching: bool = True
    min_decode_rows: int = 1  # engine.programs.min_decode_rows of the model


class SimPrograms:
    """The bucket tables a real ModelPrograms would have compiled (what decides the shapes a step runs)."""

    k = 0  # speculative tokens per decode step: the simulator models plain decoding

    def __init__(self, num_pages: int, cfg: SimConfig):
        self.num_pages, self.page_size = num_pages, cfg.page_size
        self.max_pages = -(-cfg.max_model_len // cfg.page_size)
        chunks = buckets(min(cfg.prefill_chunk, self.max_pages * cfg.page_size), 16)
        self.ready = {"prefill": sorted(prefill_shapes(chunks, cfg.prefill_chunk, cfg.max_num_seqs)),
                      "decode": decode_buckets(cfg.max_num_seqs, cfg.min_decode_rows)}

    def bucket(self, kind: str, n: int) -> int:
        if kind == "prefill":
            return next(T for B, T in self.ready["prefill"] if B == 1 and T >= n)
        return next(b for b in self.ready[kind] if b >= n)

    def prefill_batches(self, T: int) -> list[int]:
        return [B for B, t in self.ready["prefill"] if t == T]


class SimHost:
    """What an Instance asks of its Engine, on a virtual clock."""
    expert_shape = (0, 0)
    balancer = None  # the simulator models fixed expert placement

    def __init__(self, cfg: SimConfig):
        self.cfg, self.clock = cfg, 0.0
        self.max_num_seqs, self.prefill_chunk, self.max_model_len = cfg.max_num_seqs, cfg.prefill_chunk, cfg.max_model_len
        self.max_pages = -(-cfg.max_model_len // cfg.page_size)
        self.lock = threading.RLock()
        self.events: list[tuple] = []  # (time, order, kind, what): the simulation's event queue
        self.order = itertools.count()
        self.waiting: list[Request] = []
        self.role_switches: dict[tuple[str, str, str], int] = {}
        self.placements: dict[tuple[str, str], int] = {}

    def observe_expert_load(self, counts) -> None:
        pass

    def now(self) -> float:
        return self.clock

    def wake(self) -> None:
        pass

    def at(self, t: float) -> None:
        """An event at virtual time t (instances look for work at every event)."""
        heapq.heappush(self.events, (t, next(self.order), "wake", None))

    def role_switch(self, instance: str, src: str, dst: str) -> None:
        key = (instance, src, dst)
        self.role_switches[key] = self.role_switches.get(key, 0) + 1

    def done_by_length(self, req: Request, n_out: int) -> bool:
        return req.done_by_length(n_out, self.max_model_len)

    def finish(self, req: Request, reason: str, stop_reason, holder) -> None:
        req.finish_reason, req.metrics.finished_time = reason, self.clock
        if holder is not None:
            holder.scheduler.finish(req)
        key = (req.prefilled_on, req.decoded_on)
        self.placements[key] = self.placements.get(key, 0) + 1

    def append(self, req: Request, token: int, logprob, top_ids, top_lps, holder) -> None:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = self.clock
        req.output_ids.append(token)
        if self.done_by_length(req, len(req.output_ids)):
            return self.finish(req, "length", None, holder)
        if req in holder.running:
            holder.scheduler.written(req, req.num_tokens - 1)


class SimInstance(Instance):
    def __init__(self, name: str, home: str, devices: int, num_pages: int, host: SimHost, cost: CostModel,
                 policy: PDPolicy):
        super().__init__(name, home, SimPrograms(num_pages, host.cfg), host, policy=policy, waiting=host.waiting,
                         enable_prefix_caching=host.cfg.enable_prefix_caching, salt=b"sim")
        self.devices, self.cost = devices, cost
        self.busy = 0.0  # virtual seconds spent stepping

    def _copy_out(self, src_pages: list[int]) -> float:
        """Charges the transfer to this step; the KV lands on the peer (its Handoff.pages) that much later."""
        self._transfer += self.cost.transfer(len(src_pages) * self.pool.page_size, self.devices)
        landed = self.host.clock + self._transfer
        self.host.at(landed)
        return landed

    def _landed(self, h) -> bool:
        return h.pages <= self.host.clock

    def _copy_in(self, h, pages: list[int]) -> None:
        pass

    def _dispatch(self, touched, prefill):
        done = []
        if prefill is not None:
            for req, _, chunk in prefill[0]:
                self.scheduler.prefilled(req, len(chunk))
                if req.num_prefilled == len(req.prefill_ids):
                    done.append(req)
        return [("prefill", done), ("decode", list(self.running))], []

    def _read(self, pending, touched, scored=()) -> None:
        for kind, reqs in pending:
            for req in reqs:
                self._deliver(kind, req, 1, 0.0, None, None, touched)

    def step_seconds(self, shape) -> float:
        """The cost model's time for a step of this shape (Instance._shape), running alone."""
        return self.cost.step(*shape, self.devices)


@dataclasses.dataclass
class _Running:
    """A step in progress: its hand-overs, then `remaining` seconds of work (at rate 1, alone) at its
    current `rate`."""
    inst: SimInstance
    pending: tuple
    kind: str
    transfer: float  # seconds of hand-over left first: measured times, contention included, so not shared
    remaining: float
    started: float
    rate: float = 1.0
    version: int = 0  # which end event is current

    def advance(self, seconds: float) -> None:
        spent = min(self.transfer, seconds)
        self.transfer -= spent
        self.remaining -= (seconds - spent) * self.rate

    def left(self) -> float:
        return self.transfer + self.remaining / self.rate


@dataclasses.dataclass
class SimResult:
    config: SimConfig
    requests: list[Request]
    duration: float  # first arrival to last finish
    utilisation: dict[str, float]  # instance -> busy fraction of the duration
    role_switches: dict
    placements: dict

    def ttft(self) -> np.ndarray:
        return np.asarray([r.metrics.ttft for r in self.requests])

    def tpot(self) -> np.ndarray:
        return np.asarray([r.tpot if r.tpot is not None else 0.0 for r in self.requests])

    def attained(self, ttft_slo: float, tpot_slo: float) -> float:
        """The fraction of requests meeting both targets."""
        return float(np.mean((self.ttft() <= ttft_slo) & (self.tpot() <= tpot_slo)))

    def goodput(self, ttft_slo: float, tpot_slo: float, span: float) -> float:
        """Requests per second that met both targets, over the trace's arrival span."""
        return self.attained(ttft_slo, tpot_slo) * len(self.requests) / span


def simulate(trace: list[TraceRequest], cost: CostModel, cfg: SimConfig, policy: PDPolicy | None = None) -> SimResult:
    host = SimHost(cfg)
    if cfg.mode == "colocated":
        insts = [SimInstance("colocated", "mixed", cfg.devices, cost.pages(cfg.devices, cfg.page_size), host, cost,
                             PDPolicy())]
    else:
        policy = policy or PDPolicy(cfg.mode)
        n_p, n_d = cfg.prefill_devices, cfg.devices - cfg.prefill_devices
        insts = [SimInstance("prefill", "prefill", n_p, cost.pages(n_p, cfg.page_size), host, cost, policy),
                 SimInstance("decode", "decode", n_d, cost.pages(n_d, cfg.page_size), host, cost, policy)]
        insts[0].peer, insts[1].peer = insts[1], insts[0]
    rng = np.random.default_rng(0)
    reqs = []
    for i, t in enumerate(trace):
        prompt = rng.integers(3, 100_000, t.prompt_len).tolist() if t.prefix is None else \
            t.prefix + rng.integers(3, 100_000, t.prompt_len - len(t.prefix)).tolist()
        reqs.append(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=t.output_len, ignore_eos=True),
                            0, RequestMetrics(t.arrival)))
    events, order = host.events, host.order
    events += [(r.metrics.arrival_time, next(order), "arrive", r) for r in reqs]
    heapq.heapify(events)
    stepping: dict[str, _Running] = {}

    def start(inst: SimInstance) -> None:
        if inst.name in stepping or inst.idle():
            return
        pending = inst.begin([])
        shape = pending[1]
        if shape is None and not inst._transfer:
            return  # nothing runnable (e.g. requests waiting for its pages): wait for the next event
        shape = shape or (0, (0, 0), 0, 0, 0, 0)
        stepping[inst.name] = _Running(inst, pending, step_kind(shape[0]), inst._transfer, inst.step_seconds(shape),
                                       host.clock)

    def reschedule() -> None:
        """Each running step's rate given what runs beside it (processor sharing); pushes its end event."""
        for name, run in stepping.items():
            rate = 1 / (1 + sum(cost.contention[o.kind] for n, o in stepping.items() if n != name))
            if rate != run.rate or not run.version:
                run.rate, run.version = rate, run.version + 1
                heapq.heappush(events, (host.clock + run.left(), next(order), "end", (run, run.version)))

    while events:
        clock, _, kind, what = heapq.heappop(events)
        if kind == "end" and (stepping.get(what[0].inst.name) is not what[0] or what[0].version != what[1]):
            continue  # superseded by a rate change
        for run in stepping.values():
            run.advance(clock - host.clock)
        host.clock = clock
        if kind == "arrive":
            host.waiting.append(what)
        elif kind == "end":
            run = stepping.pop(what[0].inst.name)
            run.inst.busy += clock - run.started
            run.inst.end(run.pending, [])
        for inst in insts:
            start(inst)
        reschedule()
    unfinished = [r for r in reqs if not r.finished]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished (a request larger than a pool?)")
    t0 = min(r.metrics.arrival_time for r in reqs)
    duration = max(r.metrics.finished_time for r in reqs) - t0
    return SimResult(cfg, reqs, duration, {i.name: i.busy / duration for i in insts}, host.role_switches,
                     host.placements)
