"""The contract between the scheduler and a runner: what one step runs (`StepPlan`), what it produced
(`StepResult`), what it cost (`StepRecord`), and a request moving between instances (`Handoff`).

The scheduler (engine/scheduler.py) makes plans and takes results; a runner (engine/runner.py on devices,
sim/simulator.py in virtual time) executes plans and returns results. Neither calls the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ernie_jax.engine.request import Request


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    req: Request
    start: int  # position of its first token
    tokens: list[int]
    completes: bool  # it ends what the request prefills: its last logits give the request's next token


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A request moving to another instance, with its KV."""
    req: Request
    kv: Any  # the KV of its pages on the receiving side (the runner's page batch; None in the simulator)
    src_pages: list[int]  # where they were in the sender's pool
    ready_at: float  # when the KV is in place on the receiving side (the sender's clock)
    reused: int = 0  # leading pages the receiver's prefix cache holds: not sent, taken from its cache


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """What a request prefilled by another server brings (engine/kv_connector.py): the first token that server
    sampled (with its logprob entry when asked, and the MTP drafts for the next step when it speculates) and
    the prompt's KV as a page batch pulled from there (None: not pulled; the prompt is recomputed here), less
    the leading pages this engine's prefix cache already held when it asked."""
    first_token: int
    logprob: dict | None
    drafts: list[int] | None
    kv: Any
    num_pages: int  # pages in kv
    reused: int = 0  # leading prompt pages before kv's, which this engine's prefix cache holds


@dataclasses.dataclass
class StepPlan:
    """Everything one instance step does, decided at its step boundary."""
    arrived: list[tuple[Handoff, list[int]]]  # handed over to this instance: their KV goes into these pages
    hand_over: list[tuple[Request, list[int]]]  # leave for the peer with the KV of these pages (freed here)
    preempted: list[Request]  # back to the waiting queue, pages freed
    admitted: list[Request]  # took a seat and pages for prefill
    prefill: list[PrefillChunk]
    prefill_shape: tuple[int, int]  # the prefill program's (B, T); (0, 0) when none
    decode: list[Request]  # the running batch, in row order
    decode_batch: int  # the decode program's B (0: none)
    after_in_flight: bool  # the decode step's inputs are the tokens of the step still in flight (on the device)
    chain: bool  # the decode step's tokens may feed the next decode step before they are read
    role_switch: tuple[str, str] | None = None  # (from, to) when the instance's acting role changed
    decode_steps: int = 1  # decode steps its decode program runs (multi-step decode: > 1, never chained)

    @property
    def requests(self) -> list[Request]:
        return [c.req for c in self.prefill] + self.decode

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    def record_fields(self) -> tuple:
        """What this step runs, as StepRecord's fields prefill_tokens .. decode_context."""
        return (sum(len(c.tokens) for c in self.prefill), self.prefill_shape,
                sum(c.start + len(c.tokens) for c in self.prefill), len(self.decode), self.decode_batch,
                sum(r.num_tokens for r in self.decode))


@dataclasses.dataclass
class RowOutput:
    """One request's tokens from one program step."""
    req: Request
    kind: str  # "prefill" (a completed prompt's first token) or "decode"
    tokens: list[int]  # one, a speculative step's accepted drafts and the token after them, or a multi-step's
    logprobs: tuple | None = None  # (logprob, top ids, top logprobs) of a single sampled token
    drafts: list[int] | None = None  # speculative decoding: the MTP block's drafts for its next step
    accepted: int | None = None  # speculative decoding: how many drafts the target accepted


@dataclasses.dataclass
class StepResult:
    rows: list[RowOutput]  # in dispatch order
    scored: list[tuple[Request, int, list[int], Any]] = dataclasses.field(default_factory=list)  # prompt logprobs
    expert_counts: list[Any] = dataclasses.field(default_factory=list)  # tokens per expert per MoE layer, per program


class StepRecord(NamedTuple):
    """What one instance step ran, for timelines and for fitting the simulator's CPU cost model."""
    t0: float  # step boundary began
    t1: float  # results read
    prefill_tokens: int  # real prompt tokens in its prefill program (0: none)
    prefill_shape: tuple[int, int]  # the program's (B, T)
    prefill_context: int  # sum over rows of the positions the chunk attends to (start + chunk length)
    decode_rows: int  # real rows in its decode program (0: none)
    decode_batch: int  # the program's B
    decode_context: int  # sum over rows of the sequence length
    transfer_seconds: float  # of t1 - t0, the time its boundary spent handing requests' KV over
