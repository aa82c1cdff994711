"""Who does which work under prefill/decode disaggregation: the role-switching policy.

Plain Python over snapshots of queue and instance state (`InstanceView`), so the engine's instance loops
and the PD simulator (ernie_jax/sim) ask the same object. Each instance has a home role: "prefill",
"decode" or "mixed" (colocated: one instance does both). At each of its step boundaries an instance asks:

- `admit_seats`: how many waiting prompts it may take from the shared queue now;
- `handover_count`: how many of its decoding requests go to the decode instance now.

static: the prefill instance prefills and hands every finished prompt over; the decode instance never
prefills (a preempted request goes back to the queue and is prefilled again by the prefill instance).

dynamic (role switching), as far as the instance has the other role's programs compiled (a serving engine
compiles them after its own role's):
- prefill -> decode: while nothing waits and it has nothing to prefill, the prefill instance keeps the
  prompts it finished and decodes them in place (no transfer), handing over only what makes the two decode
  batches even (both instances decode; a decode step's cost grows slowly with its batch); as soon as a
  prompt waits, it hands its decoding requests over to the decode instance (as far as that one has seats
  free) and prefills.
- decode -> prefill: when prompts wait while the prefill instance is busy prefilling, and the decode
  instance's batch is at most `steal_max_occupancy` full with at least `steal_min_free_pages` of its pool
  free, it prefills waiting prompts itself (they then decode where they were prefilled: no transfer),
  filling its batch up to that occupancy.
The prefill instance admits only while the decode instance's backlog of transferred requests waiting for
pages is below `max_backlog` (prefilled KV waits in decode memory outside the pool).

Targets (optional, seconds), for deployments where the two instances slow each other (shared host cores,
a shared interconnect):
- `tpot_target`: the prefill instance decodes in place only while the recent decode steps of both
  instances take at most this; slower, it hands its decoding requests over (as far as the decode instance
  has seats). And the decode instance prefills waiting prompts only while its recent decode steps take at
  most `steal_step_fraction` of it: a prompt's chunks in its steps lengthen every decoding request's token
  gaps, so it takes prompts only with that much room (without this rule, stealing cost prompt-heavy traffic
  under a tight TPOT target a third of its SLO attainment in the simulator: benchmarks/RESULTS.md, "Role
  switching: goodput").
- `ttft_target`: once the oldest waiting prompt has waited half of this, the decode instance prefills
  waiting prompts into any free seat, not only up to `steal_max_occupancy`.

Whole-instance switching (`instance_roles`), for a deployment of more than two PD instances (a router's: one
instance a node), dynamic mode: the rules above lend work across one pair; with several instances whole
instances change their home role, one at a time, and the rules above then move the work (a new prefill
instance hands its decoding requests over as prompts wait; a new decode instance finishes its prompts and
decodes them in place):
- decode -> prefill, when prompts queue: the oldest has waited `switch_wait` (with `ttft_target`: half of
  it), and the other decode instances have seats for the switching one's requests;
- prefill -> decode, when the decode side is loaded and the prefill side has slack: nothing waits, and the
  decode instances' batches are `switch_decode_occupancy` full (with `tpot_target`: or their recent steps
  take more than `steal_step_fraction` of it);
- hysteresis: no instance switches against the direction of a switch made within `switch_dwell` seconds
  (the same instance would flap, two instances would swap roles), the two conditions leave a gap (queued
  prompts against an empty queue), one instance switches per decision, each side keeps one.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

HOME_ROLES = ("prefill", "decode", "mixed")
POLICIES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class InstanceView:
    """What the policy sees of one instance at a step boundary."""
    name: str
    home: str  # "prefill", "decode" or "mixed"
    prefilling: int  # requests whose prompt is being prefilled here
    running: int  # requests decoding here
    backlog: int  # requests handed over to this instance, waiting for its pages or seats
    max_num_seqs: int
    free_pages: int
    capacity: int  # pages in its pool
    decode_step_seconds: float = 0.0  # recent decode step time (moving average; 0: none yet)
    can_prefill: bool = True  # a prefill program is compiled (the other role's compile behind a serving engine)
    can_decode: bool = True

    @property
    def seats_free(self) -> int:
        return self.max_num_seqs - self.prefilling - self.running


@dataclasses.dataclass(frozen=True)
class PDPolicy:
    mode: str = "dynamic"
    steal_max_occupancy: float = 0.5  # decode instance prefills while its batch is at most this full
    steal_min_free_pages: float = 0.25  # ... and at least this fraction of its pool is free
    steal_min_waiting: int = 1  # ... and at least this many prompts wait
    max_backlog: int | None = None  # handed-over requests waiting at the decode instance (None: max_num_seqs)
    tpot_target: float | None = None
    ttft_target: float | None = None
    steal_step_fraction: float = 0.5  # with tpot_target: the decode instance prefills while its steps take <= this x it
    switch_wait: float = 1.0  # whole-instance switching: seconds the oldest prompt waits before decode -> prefill
    switch_decode_occupancy: float = 0.75  # ... decode batches this full (seats + backlog) before prefill -> decode
    switch_dwell: float = 30.0  # ... seconds after a switch before one in the other direction

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise ValueError(f"pd policy {self.mode!r}: expected one of {POLICIES}")
        if not 0 <= self.steal_max_occupancy <= 1 or not 0 <= self.steal_min_free_pages <= 1 or \
                not 0 <= self.steal_step_fraction <= 1:
            raise ValueError("steal_max_occupancy, steal_min_free_pages and steal_step_fraction are fractions in [0, 1]")
        if not 0 <= self.switch_decode_occupancy <= 1 or self.switch_wait < 0 or self.switch_dwell < 0:
            raise ValueError("switch_decode_occupancy is a fraction in [0, 1]; switch_wait and switch_dwell are "
                             "seconds >= 0")
        for name in ("tpot_target", "ttft_target"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")

    def admit_seats(self, me: InstanceView, waiting: int, peer: InstanceView | None, oldest_wait: float = 0.0) -> int:
        """How many waiting prompts `me` may admit for prefill now (its scheduler still checks pages).
        oldest_wait: seconds the oldest waiting prompt has waited."""
        if waiting == 0 or me.seats_free <= 0 or not me.can_prefill:
            return 0
        if me.home == "mixed":
            return me.seats_free
        if me.home == "prefill":
            backlog_limit = self.max_backlog if self.max_backlog is not None else peer.max_num_seqs
            return me.seats_free if peer.backlog < backlog_limit else 0
        if self.mode == "static" or waiting < self.steal_min_waiting or peer.prefilling == 0:
            return 0  # the prefill instance is idle (it takes the prompt at its next boundary) or static
        if self.tpot_target is not None and me.running and \
                me.decode_step_seconds > self.steal_step_fraction * self.tpot_target:
            return 0  # no room in its decode steps for a prompt's chunks within the TPOT target
        limit = int(self.steal_max_occupancy * me.max_num_seqs)
        if self.ttft_target is not None and oldest_wait >= self.ttft_target / 2:
            limit = me.max_num_seqs  # the oldest prompt's TTFT is at risk: any free seat takes prompts
        if me.free_pages < self.steal_min_free_pages * me.capacity:
            return 0
        return max(0, min(me.seats_free, limit - me.prefilling - me.running))

    def handover_count(self, me: InstanceView, waiting: int, peer: InstanceView | None) -> int:
        """How many of `me`'s decoding requests (oldest first) move to the peer now; only a prefill
        instance hands over."""
        if me.home != "prefill" or me.running == 0:
            return 0
        if self.mode == "static" or not me.can_decode:
            return me.running
        room = max(0, peer.seats_free - peer.backlog)
        if self.tpot_target is not None and max(me.decode_step_seconds, peer.decode_step_seconds) > self.tpot_target:
            return min(me.running, room)  # decoding on both sides misses the target: move it
        if waiting == 0 and me.prefilling == 0:  # nothing to prefill: share the decoding with the peer
            return min(room, max(0, (me.running - peer.running - peer.backlog) // 2))
        return min(me.running, room)

    def acting_role(self, me: InstanceView) -> str:
        """The role an instance is playing: its home role, or the other one while it holds the other's
        work (a prefill instance decoding kept requests, a decode instance prefilling prompts)."""
        if me.home == "prefill" and me.running:
            return "decode"
        if me.home == "decode" and me.prefilling:
            return "prefill"
        return me.home

    def instance_roles(self, views: Sequence[InstanceView], waiting: int, oldest_wait: float, now: float,
                       switches: Mapping[str, tuple[float, str]]) -> dict[str, str]:
        """Whole-instance switching over more than two PD instances: {name: new home role} for at most one
        instance (empty: no change). switches: each instance's last change of home role (when, to which)."""
        pd = [v for v in views if v.home in ("prefill", "decode")]
        if self.mode == "static" or len(pd) < 3:
            return {}  # two instances: the pair's rules lend the work; each side keeps one instance
        # hysteresis: no switch against the direction of one made within the dwell time (the same instance
        # would flap, two instances would swap roles)
        recent = {role for t, role in switches.values() if now - t < self.switch_dwell}
        prefill = [v for v in pd if v.home == "prefill"]
        decode = [v for v in pd if v.home == "decode"]
        load = lambda v: v.running + v.backlog  # noqa: E731
        wait_limit = self.ttft_target / 2 if self.ttft_target is not None else self.switch_wait
        if waiting and oldest_wait >= wait_limit and len(decode) > 1 and "decode" not in recent:
            for v in sorted((v for v in decode if v.can_prefill), key=load):
                room = sum(max(0, o.seats_free - o.backlog) for o in decode if o is not v)
                if room >= load(v):  # the others can take what it decodes
                    return {v.name: "prefill"}
                break  # the least loaded cannot move: none can
        if waiting == 0 and len(prefill) > 1 and "prefill" not in recent:
            seats = sum(v.max_num_seqs for v in decode)
            full = sum(load(v) for v in decode) >= self.switch_decode_occupancy * seats
            slow = self.tpot_target is not None and \
                max(v.decode_step_seconds for v in decode) > self.steal_step_fraction * self.tpot_target
            if full or slow:
                for v in sorted((v for v in prefill if v.can_decode), key=lambda v: v.prefilling):
                    return {v.name: "decode"}
        return {}
