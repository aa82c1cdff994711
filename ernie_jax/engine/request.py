"""A request as the engine tracks it: its tokens, sampling parameters, KV pages and timings."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from ernie_jax.sampling import SamplingParams, SamplingParamsError


class RequestError(ValueError):
    """A prompt or request that cannot be served; the message says which one and why, `param` names the
    request field at fault ("prompt", "max_tokens", ...)."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message)
        self.param = param


def validate(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
             kv_managers: dict, has_tokenizer: bool) -> None:
    """Whether an engine can serve this request, checked before anything is queued; raises RequestError naming
    the field. kv_managers: each instance's KV cache manager by name (the request must fit every pool it
    may run in)."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params of type {type(params).__name__}: expected SamplingParams",
                           param=None)
    try:
        params.check()  # again: a caller may have changed a field since construction
    except SamplingParamsError as e:
        raise RequestError(str(e).removeprefix("SamplingParams."), param=e.field) from None
    if not prompt_ids:
        raise RequestError("the prompt is empty")
    V = vocab_size
    if bad := [t for t in prompt_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V)]:
        raise RequestError(f"prompt token ids outside [0, {V}): {bad[:5]}")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len} "
                           "(and at least one token must be generated)")
    if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                           f"max_model_len {max_model_len}", param="max_tokens")
    if len(prompt_ids) + params.min_tokens > max_model_len:
        raise RequestError(f"{len(prompt_ids)} prompt tokens + min_tokens {params.min_tokens} exceed "
                           f"max_model_len {max_model_len}", param="min_tokens")
    longest = min(len(prompt_ids) + (params.max_tokens or max_model_len), max_model_len)
    for name, kv in kv_managers.items():
        if why := kv.check_fits(longest):
            limit = f"max_tokens {params.max_tokens}" if params.max_tokens else f"max_model_len {max_model_len}"
            raise RequestError(f"{len(prompt_ids)} prompt tokens with {limit}: {why} ({name}); lower "
                               "max_tokens or give the server more KV pages (--num-gpu-blocks-override, "
                               "--gpu-memory-utilization)", param="max_tokens")
    for field, ids in (("logit_bias", list(params.logit_bias or ())), ("stop_token_ids", params.stop_token_ids)):
        if bad := [t for t in ids if not 0 <= t < V]:
            raise RequestError(f"{field} names token ids outside [0, {V}): {bad[:5]}", param=field)
    if params.stop and not has_tokenizer:
        raise RequestError("stop strings need a tokenizer; use stop_token_ids", param="stop")
    if params.structured_outputs is not None and not has_tokenizer:
        raise RequestError("structured output needs the model's tokenizer", param=params.structured_outputs.field)


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
    export_kv: bool = False  # decoded by another server: once prefilled, its prompt's KV leaves (kv_connector)
    guide: Any = None  # structured output: its matcher (structured/guide.Guide), advanced with each token

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
        min-p are computed by the host-side sampler; a guided row's mask needs its matcher to have seen every
        token before, and the drafts are not checked against it)."""
        p = self.params
        return not (p.uses_penalties or p.logprobs is not None or p.min_p or len(self.output_ids) < p.min_tokens
                    or self.guide is not None)

    @property
    def sampling_needs_history(self) -> bool:
        """Whether each step's sampling inputs depend on the tokens before it (penalties count them, a guide
        has to consume them): such a row's decode steps do not chain on the device."""
        return self.params.uses_penalties or self.guide is not None

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
