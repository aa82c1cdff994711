"""Output processing: what a sampled token does to its request. The one place for the stop rules (EOS,
stop token ids, stop strings, max_tokens, max_model_len, min_tokens), incremental detokenization, logprob
entries and prompt logprobs; the scheduler applies a step's tokens through it, the simulator too. Also
the request-level rules `LLM` and the server share: a call's requests validated whole before any is
queued, and the `n` fan-out.

Plain Python, no JAX. It never frees pages: it says a request is finished, and the scheduler that holds
the request frees them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ernie_jax.engine.request import Request, RequestError, RequestStatus
from ernie_jax.sampling import SamplingParams


def logprob_entry(token: int, logprob, top_ids, top_lps, n: int) -> dict[str, Any]:
    """One token's logprob with its top-n alternatives, as outputs carry them."""
    return {"token": int(token), "logprob": float(logprob),
            "top": list(zip(map(int, top_ids[:n]), map(float, top_lps[:n])))}


def check_requests(validate: Callable, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    """Validate every (prompt, params) of one call before any is queued: a call is taken whole or not at
    all. validate: Engine.validate. The error names the prompt's index when the call has several."""
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        try:
            validate(ids, sp)
        except RequestError as e:
            if len(prompts) == 1:
                raise
            raise RequestError(f"prompt {i}: {e}", param=e.param) from None


def samples(params: SamplingParams) -> list[SamplingParams]:
    """The n samples of a request, each served as its own engine request (SamplingParams.for_sample gives
    each its own seed), so they batch and share the prompt's cached pages like any other requests."""
    return [params.for_sample(j) for j in range(params.n)]


class OutputProcessor:
    def __init__(self, *, max_model_len: int, eos_token_ids=frozenset(), tokenizer=None,
                 clock: Callable[[], float] = time.perf_counter):
        """clock: the time requests' metrics are stamped with (the simulator's is virtual)."""
        self.max_model_len, self.eos_token_ids, self.tokenizer = max_model_len, frozenset(eos_token_ids), tokenizer
        self.clock = clock

    def stop_ids(self, req: Request) -> set[int]:
        """The token ids that end req (once min_tokens are out)."""
        return set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.eos_token_ids))

    def done_by_length(self, req: Request, n_out: int) -> bool:
        """Whether n_out output tokens end req by length (max_tokens or max_model_len)."""
        return req.done_by_length(n_out, self.max_model_len)

    def append(self, req: Request, token: int, logprob: float = 0.0, top_ids=(), top_lps=()) -> bool:
        """A sampled token joins req's output; returns whether a stop rule finished it."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = self.clock()
        req.output_ids.append(token)
        if req.params.logprobs is not None:
            req.logprobs.append(logprob_entry(token, logprob, top_ids, top_lps, req.params.logprobs))
        if req.detokenizer is not None:
            req.text += req.detokenizer.add(token)
        n_out = len(req.output_ids)
        if req.guide is not None and not self._guided(req, token):
            return True
        if token in self.stop_ids(req) and n_out >= req.params.min_tokens:
            self.finish(req, "stop", token)
            return True
        if req.params.stop and n_out >= req.params.min_tokens:
            for s in req.params.stop:
                at = req.text.find(s)
                if at >= 0:
                    req.text = req.text[:at]
                    self.finish(req, "stop", s)
                    return True
        if self.done_by_length(req, n_out):
            self.finish(req, "length", None)
            return True
        return False

    def _guided(self, req: Request, token: int) -> bool:
        """Advance req's matcher by its token; False when that finished req: the token is an end of turn the
        grammar allowed (a stop), or the grammar is complete and takes nothing more (a stop too, as vLLM
        ends such requests). A token the grammar refuses cannot have been sampled under its mask; it is an
        error, never a silently wrong answer."""
        if not req.guide.accept(token):
            raise RuntimeError(f"{req.request_id}: token {token} is not allowed by its {req.guide.kind} constraint "
                               f"({req.guide.error})")
        stop = token in self.stop_ids(req)
        if stop or req.guide.finished:
            self.finish(req, "stop", token if stop else None)
            return False
        return True

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Mark req finished ("stop", "length" or "abort"); its text is complete."""
        if req.detokenizer is not None and not isinstance(stop_reason, str):
            req.text = self.tokenizer.decode(req.output_ids)  # includes any bytes the stream held back
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.status = RequestStatus.FINISHED
        req.metrics.finished_time = self.clock()

    def add_prompt_logprobs(self, req: Request, start: int, targets: list[int], scores) -> None:
        """A scored prefill chunk's prompt logprobs (target logprob, top ids, top logprobs per position)."""
        target_lp, top_ids, top_lps = (a[0] for a in scores)
        if start == 0:
            req.prompt_logprobs.append(None)  # nothing precedes the first prompt token
        for i, token in enumerate(targets):
            req.prompt_logprobs.append(logprob_entry(token, target_lp[i], top_ids[i], top_lps[i],
                                                     req.params.prompt_logprobs))
