"""The discrete-event PD simulator: the engine's own instances, schedulers, page pools, output rules and PD
policy, with a runner that charges a cost model's time instead of running programs, on a virtual clock.

`SimRunner` replaces only the engine's runner: a step "runs" for the cost model's time of what its plan
dispatches (the shapes the real instance would run: bucketed prefill (B, T), decode batch, contexts),
every decoding row gets one token, a completed prompt its first token. Hand-overs cost the sender the
transfer time of the request's pages, and the request reaches the receiver once that time has passed.
Two steps running at once share the machine as the cost model's `contention` says (processor sharing:
each progresses at 1 / (1 + the contention of the other's kind); hand-over times are not shared, being
measured as they ran). Everything else (admission with its bypass rule, pages on demand, preemption,
prefix caching, hand-over and role-switching decisions, the stop rules) is the engine's code. The trace
fixes output lengths (requests ignore EOS), so requests end by length.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading

import numpy as np

from ernie_jax.engine.instance import Instance
from ernie_jax.engine.kv_cache_manager import KVCacheManager
from ernie_jax.engine.output_processor import OutputProcessor
from ernie_jax.engine.pages import PagePool
from ernie_jax.engine.policy import PDPolicy
from ernie_jax.engine.request import Request, RequestMetrics
from ernie_jax.engine.scheduler import Scheduler
from ernie_jax.engine.shapes import ShapeTable, step_shapes, table_pages
from ernie_jax.engine.step import RowOutput, StepPlan, StepResult
from ernie_jax.sampling import SamplingParams
from ernie_jax.sim.cost import CostModel, step_kind
from ernie_jax.sim.traces import TraceRequest


@dataclasses.dataclass
class SimConfig:
    """One simulated deployment: colocated on all devices, or PD with `prefill_devices` of them; or, with
    `instances`, several instances of their own devices behind a router (one a node), each with a home role
    ("mixed" for colocated; "prefill" / "decode" for PD), `devices` then being their total."""
    mode: str  # "colocated", "static" or "dynamic"
    devices: int
    prefill_devices: int = 0  # PD only
    instances: tuple[tuple[str, int], ...] = ()  # (home role, devices) each; () = the layout above
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 64
    max_model_len: int = 16384
    enable_prefix_caching: bool = True
    min_decode_rows: int = 1  # engine.cpu_rules.min_decode_rows of the model


class SimRunner:
    """The engine's runner contract in virtual time: plans in, one token per row out, costs from the model."""

    in_flight = None  # the simulator's schedulers do not chain decode steps (overlap=False)
    programs = None  # no compiled programs (the simulator models fixed expert placement: no EPLB)

    def __init__(self, devices: int, cost: CostModel, page_size: int):
        self.devices, self.cost, self.page_size = devices, cost, page_size
        self.busy = 0.0  # virtual seconds spent stepping
        self.in_step: list = []

    def copy_out(self, src_pages: list[int]) -> tuple[None, float]:
        return None, self.cost.transfer(len(src_pages) * self.page_size, self.devices)

    def copy_in(self, h, pages: list[int], sender) -> None:
        pass

    def dispatch(self, plan: StepPlan) -> tuple[StepPlan, list]:
        return plan, []

    def read(self, plan: StepPlan, scored=()) -> StepResult:
        rows = [RowOutput(c.req, "prefill", [1]) for c in plan.prefill if c.completes]
        return StepResult(rows + [RowOutput(r, "decode", [1]) for r in plan.decode])

    def seconds(self, plan: StepPlan) -> float:
        """The cost model's time for this plan's step, running alone."""
        return self.cost.step(*plan.record_fields(), self.devices)


def _instance(name: str, home: str, devices: int, cfg: SimConfig, cost: CostModel, policy: PDPolicy,
              waiting: list[Request], outputs: OutputProcessor, clock) -> Instance:
    """An engine instance over a simulated runner, sized and shaped as Engine sizes and shapes a real one."""
    budget, _, prefills, decodes = step_shapes(max_num_batched_tokens=cfg.max_num_batched_tokens,
                                               max_model_len=cfg.max_model_len, page_size=cfg.block_size,
                                               max_num_seqs=cfg.max_num_seqs, min_decode_rows=cfg.min_decode_rows)
    pool = PagePool(cost.pages(devices, cfg.block_size), cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                    salt=b"sim")
    kv = KVCacheManager(pool, max_pages=table_pages(cfg.max_model_len, cfg.block_size))
    scheduler = Scheduler(name, home, kv, waiting, policy=policy, shapes=ShapeTable(prefills, decodes),
                          outputs=outputs, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=budget,
                          overlap=False)
    return Instance(name, home, scheduler, SimRunner(devices, cost, cfg.block_size), lock=threading.RLock(),
                    clock=clock)


@dataclasses.dataclass
class _Running:
    """A step in progress: its hand-overs, then `remaining` seconds of work (at rate 1, alone) at its
    current `rate`."""
    inst: Instance
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
    pd_requests: dict  # finished requests by (prefilled on, decoded on)
    instance_switches: list = dataclasses.field(default_factory=list)  # (seconds, instance, from, to)

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


def simulate(trace: list[TraceRequest], cost: CostModel, cfg: SimConfig, policy: PDPolicy | None = None,
             concurrency: int | None = None) -> SimResult:
    """concurrency: clients that each send their next request when their last one has finished (a benchmark
    client's closed loop, as `bench serve --concurrency` runs): requests go out in trace order, each at its
    arrival or when a client is free, whichever is later; None: every request at its arrival (open loop)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be at least 1 (or None for arrivals on the trace's clock)")
    clock = [0.0]
    now = lambda: clock[0]  # noqa: E731
    waiting: list[Request] = []
    outputs = OutputProcessor(max_model_len=cfg.max_model_len, clock=now)
    layout = cfg.instances or ((("mixed", cfg.devices),) if cfg.mode == "colocated" else
                               (("prefill", cfg.prefill_devices), ("decode", cfg.devices - cfg.prefill_devices)))
    if (cfg.mode == "colocated") != all(home == "mixed" for home, _ in layout):
        raise ValueError(f"{cfg.mode} deployment with instances {layout}: colocated means mixed instances only")
    policy = PDPolicy() if cfg.mode == "colocated" else policy or PDPolicy(cfg.mode)
    named = len(layout) > 2 or cfg.mode == "colocated" and len(layout) > 1
    insts = [_instance(f"{home}{i}" if named else home, home, n, cfg, cost, policy, waiting, outputs, now)
             for i, (home, n) in enumerate(layout)]
    switches: dict[str, tuple[float, str]] = {}
    instance_switches: list = []

    def route() -> None:
        """The router's choice of peers, at each event: a prefill instance hands over to the decode instance
        with the most room; a decode instance weighs prompt stealing against the least busy prefill instance
        (with one of each, they are each other's peer, as in one server)."""
        prefill = [i for i in insts if i.home == "prefill"]
        decode = [i for i in insts if i.home == "decode"]
        for inst in prefill:
            inst.peer = max(decode, key=lambda o: o.scheduler.view().seats_free - len(o.scheduler.incoming),
                            default=None)
        for inst in decode:
            inst.peer = min(prefill, key=lambda o: len(o.scheduler.prefilling), default=None)

    def switch_roles() -> None:
        views = [i.scheduler.view() for i in insts]
        oldest = clock[0] - waiting[0].metrics.arrival_time if waiting else 0.0
        for name, role in policy.instance_roles(views, len(waiting), oldest, clock[0], switches).items():
            inst = next(i for i in insts if i.name == name)
            instance_switches.append((clock[0], name, inst.home, role))
            inst.home = inst.scheduler.home = role
            switches[name] = (clock[0], role)
    rng = np.random.default_rng(0)
    reqs = []
    for i, t in enumerate(trace):
        prompt = rng.integers(3, 100_000, t.prompt_len).tolist() if t.prefix is None else \
            t.prefix + rng.integers(3, 100_000, t.prompt_len - len(t.prefix)).tolist()
        reqs.append(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=t.output_len, ignore_eos=True),
                            0, RequestMetrics(t.arrival)))
    order = itertools.count()
    unsent = reqs[concurrency:] if concurrency else []
    unsent.reverse()
    events = [(r.metrics.arrival_time, next(order), "arrive", r) for r in reqs[:concurrency]]
    heapq.heapify(events)
    stepping: dict[str, _Running] = {}
    role_switches: dict[tuple[str, str, str], int] = {}
    pd_requests: dict[tuple[str, str], int] = {}

    def start(inst: Instance) -> None:
        if inst.name in stepping or inst.idle():
            return
        begun = inst.begin()
        plan = begun[1]
        for h in inst.peer.inbox if plan.hand_over else ():
            heapq.heappush(events, (h.ready_at, next(order), "wake", None))  # the receiver looks when it lands
        if plan.empty and not inst.transfer_seconds:
            return  # nothing runnable (e.g. requests waiting for its pages): wait for the next event
        stepping[inst.name] = _Running(inst, begun, step_kind(plan.record_fields()[0]), inst.transfer_seconds,
                                       inst.runner.seconds(plan), clock[0])

    def reschedule() -> None:
        """Each running step's rate given what runs beside it (processor sharing); pushes its end event."""
        for name, run in stepping.items():
            rate = 1 / (1 + sum(cost.contention[o.kind] for n, o in stepping.items() if n != name))
            if rate != run.rate or not run.version:
                run.rate, run.version = rate, run.version + 1
                heapq.heappush(events, (clock[0] + run.left(), next(order), "end", (run, run.version)))

    while events:
        t, _, kind, what = heapq.heappop(events)
        if kind == "end" and (stepping.get(what[0].inst.name) is not what[0] or what[0].version != what[1]):
            continue  # superseded by a rate change
        for run in stepping.values():
            run.advance(t - clock[0])
        clock[0] = t
        if kind == "arrive":
            waiting.append(what)
        elif kind == "end":
            run = stepping.pop(what[0].inst.name)
            run.inst.runner.busy += t - run.started
            out = run.inst.end(run.pending)
            if out.role_switch is not None:
                key = (run.inst.name, *out.role_switch)
                role_switches[key] = role_switches.get(key, 0) + 1
            for req in out.touched:
                if req.finished:
                    key = (req.prefilled_on, req.decoded_on)
                    pd_requests[key] = pd_requests.get(key, 0) + 1
                    if unsent:  # its client sends the next request
                        nxt = unsent.pop()
                        nxt.metrics.arrival_time = max(nxt.metrics.arrival_time, t)
                        heapq.heappush(events, (nxt.metrics.arrival_time, next(order), "arrive", nxt))
        if len(insts) > 2:
            switch_roles()
        route()
        for inst in insts:
            start(inst)
        reschedule()
    unfinished = [r for r in reqs if not r.finished]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} requests never finished (a request larger than a pool?)")
    t0 = min(r.metrics.arrival_time for r in reqs)
    duration = max(r.metrics.finished_time for r in reqs) - t0
    return SimResult(cfg, reqs, duration, {i.name: i.runner.busy / duration for i in insts}, role_switches,
                     pd_requests, instance_switches)
