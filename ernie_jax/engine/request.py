"""A request as the engine tracks it: its tokens, sampling parameters, KV pages and timings."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ernie_jax.sampling import SamplingParams


class RequestError(ValueError):
    """A prompt or request that cannot be served; the message says which one and why, `param` names the
    request field at fault ("prompt", "max_tokens", ...)."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message)
        self.param = param


class RequestStatus(enum.Enum):
    """Where a request is; `Request.holder` names the instance for the middle three."""
    WAITING = "waiting"  # in the shared queue (new, or preempted)
    PREFILLING = "prefilling"  # holds a seat and its prompt's pages; chunks of its prompt are being computed
    RUNNING = "running"  # decoding
    HANDING_OVER = "handing_over"  # moving to another instance with its KV (PD)
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampler's 32-bit seed (sampling.sampler_seed)
    metrics: RequestMetrics
    status: RequestStatus = RequestStatus.WAITING
    holder: str | None = None  # the instance holding its seat and pages (or sending it, or receiving it)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)  # None for token 0
    pages: list[int] = dataclasses.field(default_factory=list)  # in the pool of the instance holding it
    # What the current prefill computes: the prompt, followed, after a preemption, by the tokens already
    # produced (they are kept and recomputed into the cache, never sent again).
    prefill_ids: list[int] = dataclasses.field(default_factory=list)
    num_prefilled: int = 0  # tokens of prefill_ids whose KV is in the pages (cached or computed)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first admission
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # hash chain of the full pages so far
    num_registered: int = 0  # leading pages of the caching pool's pages registered in its prefix cache
    admitted: int = -1  # admission order: preemption takes the latest
    num_preemptions: int = 0
    bypassed: int = 0  # admissions that went past this request while it waited at the head of the queue
    prefilled_on: str | None = None  # the instance that prefilled it (last, after preemptions)
    decoded_on: str | None = None  # the instance that produced its last token
    abort_requested: bool = False  # set by another thread; the instance holding it finishes it
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # with a tokenizer: the detokenized output (cut before a stop string)
    detokenizer: Any = None  # IncrementalDetokenizer when the engine has a tokenizer
    drafts: list[int] | None = None  # speculative decoding: the MTP block's drafts for its next step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill returns prompt logprobs (every position's logits: the cache is bypassed)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def speculates(self) -> bool:
        """Whether its next decode step may accept drafts: its sampler needs nothing but temperature, top-p
        and top-k (penalties, logit_bias and min_tokens need every previous token on the host; logprobs and
        min-p are computed by the host-side sampler)."""
        p = self.params
        return not (p.uses_penalties or p.logprobs is not None or p.min_p or len(self.output_ids) < p.min_tokens)

    def done_by_length(self, n_out: int, max_model_len: int) -> bool:
        """Whether n_out output tokens end it by length (max_tokens or max_model_len)."""
        return (self.params.max_tokens is not None and n_out >= self.params.max_tokens) or \
            len(self.prompt_ids) + n_out >= max_model_len

    @property
    def tpot(self) -> float | None:
        m = self.metrics
        if m.finished_time is None or m.first_token_time is None or len(self.output_ids) < 2:
            return None
        return (m.finished_time - m.first_token_time) / (len(self.output_ids) - 1)
