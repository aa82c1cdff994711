"""The OpenAI request bodies the server accepts, and their translation to engine SamplingParams.

Unknown fields are ignored (clients send many extensions); known fields with a wrong type are rejected
(a string where a number belongs is an error, not a coercion). Fields the server cannot honour (tools,
structured output, best_of > n) are rejected by name instead of being silently ignored. Sampling defaults
come from the model's generation_config.json (ERNIE: temperature 0.8, top_p 0.8), as in vLLM.

Everything a request carries is checked here or by SamplingParams / Engine.validate before it is queued,
each failure a 400 naming the field: numbers finite and in range (SamplingParams states the ranges),
strings valid Unicode (JSON can carry a lone surrogate, UTF-8 cannot), message content as OpenAI defines it
per role, and list sizes bounded (the MAX_* limits below; the body's size is bounded by the server).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ernie_jax.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from ernie_jax.tokenizer import check_text

# JSON integers are taken (as floats), strings and booleans refused with one "valid number" error (a union of
# int and float reported only its first alternative: "a valid integer"); NaN and infinities (which Python's
# JSON parser accepts) are refused by the models' allow_inf_nan=False.
Number = StrictFloat


def _valid_text(text: str) -> str:
    check_text(text)
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_text)]

# The most entries a request's lists may hold (OpenAI allows 4 stop strings and 128 tools; vLLM sets no
# limits): generous for real clients, and they bound the work one request can cause before it is queued.
MAX_STOP = 64
MAX_TOKEN_LIST = 1024  # stop_token_ids, logit_bias entries
MAX_MESSAGES = 4096
MAX_PARTS = 1024  # text parts of one message
MAX_PROMPTS = 1024  # prompts of one batched completion request
MAX_TOOLS = 128


class ProtocolError(ValueError):
    """A request the server refuses; `status` is the HTTP status and `param` the offending field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extensions)."""
    model: Text | None = None
    n: StrictInt = 1
    best_of: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    logit_bias: Annotated[dict[Text, Number], Field(max_length=MAX_TOKEN_LIST)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM's field for prefill/decode across servers: {"do_remote_decode": true} asks a prefill server to keep
    # the prompt's KV; a decode server gets what that server answered, plus "remote_url" (serve/pd.py)
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of other than n is not supported", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed with stream=true", param="stream_options")
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                "frequency_penalty", "repetition_penalty")}
        values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        try:
            return SamplingParams(**values, n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                                  seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                                  ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  logit_bias=self.logit_bias)
        except SamplingParamsError as e:
            raise ProtocolError(str(e).removeprefix("SamplingParams."), param=e.field) from None


class CompletionRequest(_Sampling):
    prompt: Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | list[StrictInt] | \
        Annotated[list[list[StrictInt]], Field(max_length=MAX_PROMPTS)]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ProtocolError("prompt is empty", param="prompt")
        return [p] if isinstance(p[0], int) else list(p)

    def to_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.suffix:
            raise ProtocolError("suffix is not supported", param="suffix")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise ProtocolError("max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                                param="max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        # max_tokens 0 with echo scores the prompt: one token is generated and dropped from the answer.
        return self.sampling_params(defaults, max(self.max_tokens, 1) if self.max_tokens is not None else None,
                                    self.logprobs, self.logprobs if self.echo and self.logprobs is not None else None)


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    # null only where OpenAI allows it: an assistant turn with tool_calls, which this server does not take yet
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    response_format: dict | None = None

    def conversation(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            if m.content is None:
                raise ProtocolError(f"messages[{i}].content is null: a {m.role} message needs content (a string "
                                    "or a list of text parts)", param=f"messages.{i}.content")
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            # "developer" is OpenAI's newer name for the system role.
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out

    def to_params(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.tools:
            raise ProtocolError("tool calling is not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ProtocolError("structured output (response_format other than text) is not supported",
                                param="response_format")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ProtocolError("max_tokens must be at least 1", param="max_completion_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ProtocolError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ProtocolError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return self.sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
            429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
