"""One engine instance: a scheduler and a runner over one (sub)mesh, and the step that drives them.

Colocated serving has one instance, named after its home role "mixed" (FastDeploy's name for a server that
does both); prefill/decode disaggregation two ("prefill" and "decode", on disjoint submeshes, each with its
own weights). Each steps on its own:
`begin()` is the step boundary and the dispatch (the scheduler's calls in its documented order, the
runner's copies for requests arriving and leaving, then the plan dispatched), `end()` reads the results
and hands them to the scheduler. Under an AsyncEngine each instance has its own thread; `Engine.step()`
steps them in turn (both dispatched before either is read). The instance decides nothing itself: the
scheduler plans, the runner executes, and what the engine must know (requests touched, finished, a role
switch, a re-placement due) comes back in `StepOutputs`.

Hand-over (PD): the plan names the requests leaving; the runner copies their pages onto the peer's mesh
(this thread waits for the copy) and they join the peer's `incoming` with their KV; the peer's scheduler
takes them at its next boundary and its runner scatters the KV in.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, NamedTuple

from ernie_jax.engine.policy import InstanceView
from ernie_jax.engine.request import Request
from ernie_jax.engine.scheduler import Scheduler
from ernie_jax.engine.step import Handoff, StepPlan, StepRecord, StepResult


class StepOutputs(NamedTuple):
    touched: list[Request]  # got a token or finished (aborted ones included), in order
    role_switch: tuple[str, str] | None  # (from, to) when the instance's acting role changed
    rebalance: bool  # EPLB's step interval says re-place the experts now
    handed_over: int  # requests sent to the peer


class Instance:
    def __init__(self, name: str, home: str, scheduler: Scheduler, runner, *, lock: threading.RLock,
                 clock: Callable[[], float] = time.perf_counter, balancer=None):
        """runner: engine/runner.ModelRunner, or the simulator's. lock: the engine's (the shared queue, the
        schedulers' state). balancer: EPLB (engine/expert_balance.py) or None."""
        self.name, self.home, self.scheduler, self.runner = name, home, scheduler, runner
        self.lock, self.clock, self.balancer = lock, clock, balancer
        self.peer: Instance | None = None
        self.timeline: collections.deque[StepRecord] = collections.deque(maxlen=100_000)
        self.transfer_seconds = 0.0  # of the step being taken, the time its boundary spent handing KV over

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def programs(self):
        return self.runner.programs

    @property
    def policy(self):
        """The PD policy its scheduler asks (engine/policy.py)."""
        return self.scheduler.policy

    @policy.setter
    def policy(self, policy) -> None:
        self.scheduler.policy = policy

    @property
    def transfer(self):
        """The page transfer to the peer (PD, the sending side), or None."""
        return self.runner.transfer

    @property
    def pool(self):
        return self.scheduler.pool

    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def inbox(self) -> list[Handoff]:
        return self.scheduler.incoming

    def view(self) -> InstanceView:
        return self.scheduler.view()

    def _peer_view(self) -> InstanceView | None:
        return self.peer.view() if self.peer else None

    def holds(self, req: Request) -> bool:
        return self.scheduler.holds(req)

    def idle(self) -> bool:
        """Nothing to run and nothing it may take from the queue now."""
        with self.lock:
            return self.scheduler.idle(self._peer_view(), self.clock())

    # ---- a step -------------------------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        return self.end(self.begin())

    def begin(self):
        """The step boundary and the plan's dispatch; returns what end() reads."""
        t0, self.transfer_seconds, self.runner.in_step = self.clock(), 0.0, []
        self.take_placement()
        touched: list[Request] = []
        with self.lock:
            touched += self.scheduler.drop_aborted()
            arrived = self.scheduler.receive(self.clock())
        for h, pages in arrived:
            self.runner.copy_in(h, pages, self.peer.runner if self.peer else None)
        rebalance = False
        flight = self.runner.in_flight
        with self.lock:
            sync = flight is not None and self.scheduler.needs_host_tokens(self._peer_view(), flight)
        if sync:  # the batch changes: the step in flight's tokens are needed on the host first
            more, rebalance = self._apply(self.runner.read_in_flight())
            touched += more
            flight = None
        with self.lock:
            plan = self.scheduler.schedule(self.clock(), self._peer_view(), arrived, flight)
        self._send(plan, t0)
        pending = self.runner.dispatch(plan)
        self.scheduler.dispatched(plan)
        return t0, plan, pending, touched, rebalance

    def end(self, begun) -> StepOutputs:
        t0, plan, pending, touched, rebalance = begun
        more, due = self._apply(self.runner.read(*pending))
        with self.lock:
            exports = self.scheduler.take_exports()
        for req, pages in exports:  # before the next step's programs can write these pages
            self.runner.export(req, pages)
        if not plan.empty:
            record = StepRecord(t0, self.clock(), *plan.record_fields(), self.transfer_seconds)
            self.timeline.append(record)
            if record.decode_rows:
                self.scheduler.observe_step((record.t1 - record.t0) / plan.decode_steps)
        return StepOutputs(touched + more, plan.role_switch, rebalance or due, len(plan.hand_over))

    def _apply(self, result: StepResult) -> tuple[list[Request], bool]:
        """A step's results to the scheduler; returns the requests touched and whether EPLB is due."""
        with self.lock:
            touched = self.scheduler.update(result)
        due = False
        if self.balancer is not None:
            for counts in result.expert_counts:
                due |= self.balancer.observe(counts)
        return touched, due

    def _send(self, plan: StepPlan, t0: float) -> None:
        """The plan's hand-overs: copy each request's pages onto the peer, then queue it there."""
        for req, pages in plan.hand_over:
            t = time.perf_counter()
            kv, seconds = self.runner.copy_out(pages)
            self.transfer_seconds += seconds if seconds is not None else time.perf_counter() - t
            with self.lock:  # one step for an abort to see: held here, or in the peer's inbox
                self.scheduler.sent(req)
                req.holder = self.peer.name
                self.peer.scheduler.incoming.append(Handoff(req, kv, pages, t0 + self.transfer_seconds))

    def take_placement(self) -> None:
        """EPLB: move the experts into a re-placement queued for this instance (between steps)."""
        if self.balancer is not None and (placement := self.balancer.take_pending(self.name)) is not None:
            self.programs.place_experts(placement)

    def recover(self) -> tuple[list[Request], bool]:
        """After a step raised: fail (finish as aborted) the requests it ran; returns them and whether the pool
        was kept.

        When the pool is intact (ModelPrograms.cache_intact: the failure was on the host, or a program refused
        its inputs before running), only the requests of the failed step fail, their pages freed as at any
        finish, and the pool keeps its prefix cache: every page registered so far was written by a program
        that completed. Otherwise (a program failed on the device: every program donates the pool, so it may
        be consumed or half written) the pool is rebuilt zeroed, its prefix cache forgotten, the step in
        flight dropped, and every request that held pages here fails. Waiting and inbox ones stay."""
        s = self.scheduler
        failed = [r for r in {id(r): r for r in self.runner.in_step}.values() if s.holds(r) and not r.finished]
        self.runner.in_step = []
        if not (failed and self.programs.cache_intact()):
            failed = []
        with self.lock:
            for req in failed:
                s.abort(req)
        if failed:
            try:
                s.kv.check()
                return failed, True
            except AssertionError:  # the failure left the page bookkeeping inconsistent: start afresh
                pass
        self.runner.drop_in_flight()
        with self.lock:
            lost = [r for q in (s.prefilling, s.running) for r in q]
            for req in lost:
                s.abort(req)
        self.programs.reset_cache()
        self.pool.reset_cache()
        return failed + lost, False
