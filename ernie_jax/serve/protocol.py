"""The OpenAI request bodies the server accepts, and their translation to engine SamplingParams.

Unknown fields are ignored (clients send many extensions); known fields with a wrong type are rejected
(a string where a number belongs is an error, not a coercion). Fields the server cannot honour (best_of >
n, a response_format type other than text / json_object / json_schema) are rejected by name instead of
being silently ignored. Sampling defaults come from the model's generation_config.json (ERNIE: temperature
0.8, top_p 0.8), as in vLLM.

Structured output comes as OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, or vLLM's newer `structured_outputs` object; at most one per request,
and none beside a `tool_choice` that forces a call (that choice is itself a grammar: structured/tools.py).

Everything a request carries is checked here or by SamplingParams / Engine.validate before it is queued,
each failure a 400 naming the field: numbers finite and in range (SamplingParams states the ranges),
strings valid Unicode (JSON can carry a lone surrogate, UTF-8 cannot), message content as OpenAI defines it
per role, and list sizes bounded (the MAX_* limits below; the body's size is bounded by the server).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ernie_jax.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from ernie_jax.structured import tools as tool_calls
from ernie_jax.structured.spec import KINDS, StructuredOutputError, StructuredOutputsParams
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
    # structured output (the module docstring)
    response_format: dict | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(max_length=1024)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: dict | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's one structured-output constraint, or None; a ProtocolError names the field."""
        try:
            given = self._constraints()
        except StructuredOutputError as e:
            raise ProtocolError(str(e), param=e.field) from None
        if len(given) > 1:
            raise ProtocolError(f"give at most one structured-output constraint (got {', '.join(g.field for g in given)})",
                                param=given[1].field)
        return given[0] if given else None

    def _constraints(self) -> list[StructuredOutputsParams]:
        given = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                given.append(StructuredOutputsParams(json_object=True, field="response_format"))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or "schema" not in spec:
                    raise StructuredOutputError("response_format", "response_format: type json_schema needs "
                                                "json_schema.schema (the JSON schema)")
                given.append(StructuredOutputsParams(json=spec["schema"], field="response_format"))
            elif kind != "text":
                raise StructuredOutputError("response_format", f"response_format: type {kind!r} is not supported "
                                            "(text, json_object, json_schema)")
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append(StructuredOutputsParams(**{kind: getattr(self, name)}, field=name))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if unknown := [k for k, v in so.items() if k not in KINDS and v is not None]:
                raise StructuredOutputError("structured_outputs", f"structured_outputs: {', '.join(unknown)} "
                                            f"is not supported (one of {', '.join(KINDS)})")
            given.append(StructuredOutputsParams(**{k: so[k] for k in KINDS if k in so}, field="structured_outputs"))
        return given

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
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
                                  logit_bias=self.logit_bias,
                                  structured_outputs=constraint if constraint is not None else self.constraint())
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
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # null only where OpenAI allows it: an assistant turn with tool_calls
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    tool_calls: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: StrictBool = True

    def tool_list(self) -> list[tool_calls.Tool]:
        try:
            return tool_calls.parse_tools(self.tools or [])
        except StructuredOutputError as e:
            raise ProtocolError(str(e), param=e.field) from None

    def tool_mode(self) -> str | tool_calls.Tool | None:
        """None (no tool calls: no tools, or tool_choice "none"), "auto", "required" or the named Tool."""
        try:
            return tool_calls.resolve_choice(self.tool_list(), self.tool_choice)
        except StructuredOutputError as e:
            raise ProtocolError(str(e), param=e.field) from None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them, with the tools and tool turns rendered as text."""
        out = []
        for i, m in enumerate(self.messages):
            calls = self._calls(i, m)
            if m.content is None and not calls:
                raise ProtocolError(f"messages[{i}].content is null: a {m.role} message needs content (a string "
                                    "or a list of text parts)", param=f"messages.{i}.content")
            content = "" if m.content is None else m.content if isinstance(m.content, str) else \
                "".join(p.text for p in m.content)
            # "developer" is OpenAI's newer name for the system role.
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content, "tool_calls": calls})
        return tool_calls.render(out, self.tool_list() if self.tool_mode() is not None else [])

    @staticmethod
    def _calls(i: int, m: ChatMessage) -> list[dict]:
        """An assistant turn's tool_calls as {"name", "arguments" (an object)}."""
        if not m.tool_calls:
            return []
        if m.role != "assistant":
            raise ProtocolError(f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages.{i}")
        out = []
        for j, c in enumerate(m.tool_calls):
            f = c.get("function") if isinstance(c, dict) else None
            try:
                arguments = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
                if not isinstance(f["name"], str) or not isinstance(arguments, dict):
                    raise TypeError
            except (TypeError, KeyError, json.JSONDecodeError):
                raise ProtocolError(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\": ..., "
                                    "\"arguments\": <a JSON object or its text>}}", param=f"messages.{i}.tool_calls") \
                    from None
            out.append({"name": f["name"], "arguments": arguments})
        return out

    def to_params(self, defaults: dict[str, Any]) -> SamplingParams:
        mode = self.tool_mode()
        forced = tool_calls.constraint(self.tool_list(), mode, self.parallel_tool_calls) if mode is not None else None
        own = self.constraint()
        if forced is not None and own is not None:
            raise ProtocolError(f"tool_choice {self.tool_choice!r} forces a tool call; it cannot be combined with "
                                f"{own.field}", param="tool_choice")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ProtocolError("max_tokens must be at least 1", param="max_completion_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ProtocolError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ProtocolError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return self.sampling_params(defaults, max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                    constraint=forced or own)


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a prompt, or chat messages (with tools) rendered by the chat template."""
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=1 << 20)]


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
            429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
