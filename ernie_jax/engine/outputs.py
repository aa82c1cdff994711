"""What a request returns: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

import dataclasses

from ernie_jax.engine.request import Request


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[dict] | None = None  # per token: {"token", "logprob", "top": [(id, logprob), ...]}


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict | None = None  # queue_time, ttft, tpot (seconds)
    prompt_logprobs: list[dict | None] | None = None  # with SamplingParams.prompt_logprobs; None for token 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache


def request_output(req: Request, prompt: str | None, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
    m = req.metrics
    return RequestOutput(req.request_id, prompt, req.prompt_ids, outputs, finished,
                         {"queue_time": m.queue_time, "ttft": m.ttft, "tpot": req.tpot},
                         list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
                         req.num_cached_tokens)


def completion(req: Request, index: int = 0) -> CompletionOutput:
    return CompletionOutput(index, req.text, list(req.output_ids),
                            req.finish_reason, req.stop_reason, list(req.logprobs) if req.params.logprobs is not None
                            else None)
