"""The OpenAI-compatible HTTP routes over one AsyncEngine.

`create_app(server)` builds the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (streaming
as SSE with `data: [DONE]`; structured output, tool calls and, with a reasoning parser, reasoning_content),
/tokenize and /detokenize (vLLM's), /health and /metrics. A request body is validated in full before anything is
queued; a prompt list or `n` > 1 becomes several engine requests whose outputs are merged into one answer.
Errors are OpenAI-shaped JSON with their HTTP status, never a stack trace (an unexpected error is logged and
answered with a plain 500). A body over `max_request_bytes` gets a 413 before it is parsed. A client that
disconnects aborts its engine requests
(streaming: Starlette cancels the body iterator; otherwise a watcher on the connection cancels the handler),
which frees their KV pages at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ernie_jax.engine.async_engine import EngineError
from ernie_jax.engine.client import EngineClient, NoExpertBalancer
from ernie_jax.engine.request import RequestError
from ernie_jax.engine.output_processor import check_requests, samples
from ernie_jax.engine.outputs import RequestOutput
from ernie_jax.sampling import SamplingParams
from ernie_jax.serve.metrics import ServerMetrics
from ernie_jax.serve.pd import PDServer, add_pd_routes
from ernie_jax.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ProtocolError,
                                     TokenizeRequest, error_body)
from ernie_jax.structured import reasoning, tools as tool_calls
from ernie_jax.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger("ernie_jax.serve")


@dataclasses.dataclass
class Server:
    """What the routes need: the engine, tokenizer, names and limits."""
    engine: EngineClient
    tokenizer: Tokenizer
    model_name: str
    defaults: dict[str, Any]  # sampling defaults from generation_config.json
    metrics: ServerMetrics
    max_queue_len: int = 256
    max_n: int = 16
    api_key: str | None = None  # when set, /v1 routes need "Authorization: Bearer <key>"
    max_request_bytes: int = 8 * 2**20  # larger request bodies get 413
    pd: PDServer = dataclasses.field(default_factory=PDServer)  # prefill/decode across servers (serve/pd.py)
    reasoning_parser: str | None = None  # "ernie45": <think>...</think> becomes reasoning_content
    structured_output: bool = True  # False (--guided-decoding-backend off): constraints are refused
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class _Prompt:
    text: str | None
    ids: list[int]


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ernie_jax", docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_BodyLimit, server=server)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization") != f"Bearer {server.api_key}":
            return _error(server, "missing or wrong API key (Authorization: Bearer <key>)", 401)
        return await call_next(request)

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, e: ProtocolError):
        return _error(server, str(e), e.status, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        # A union field reports one error per alternative; a type mismatch ("string_type") is the least telling
        # ("stop": 65 strings is a list that is too long, not a string of the wrong type).
        first = next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0])
        if first.get("type") == "json_invalid":
            return _error(server, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", 400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        # A union field reports one error per alternative; name the field and what it got, once.
        param = ".".join(x for x in loc if not x[0].isupper() and "[" not in x and x not in
                         ("str", "int", "float", "list", "list[int]", "list[str]")) or None
        got = first.get("input")
        message = (f"field '{param}': {first.get('msg')}" + (f" (got {json.dumps(got)[:80]})" if got is not None
                                                            and first.get("type") != "missing" else "")
                   if param else f"invalid request body: {first.get('msg')}")
        return _error(server, message, 400, param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return _error(server, str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(server, "internal server error (the server log has the details)", 500)

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.alive:
            failed = getattr(server.engine, "failed", None)
            return _error(server, f"the engine serves nothing more: {failed}" if failed else
                          "the engine thread has stopped", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        info = server.engine.info()
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "ernie_jax", "root": server.model_name,
                                            "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                                            "engine_config": info.config}]}

    @app.post("/v1/admin/rebalance_experts")
    async def rebalance_experts() -> dict:
        """EPLB: re-place the redundant experts from the measured load now (behind the API key, like every
        /v1 route); the instances move their experts at their next step boundaries."""
        try:
            return await asyncio.to_thread(server.engine.rebalance_experts)
        except NoExpertBalancer:
            raise ProtocolError("this server has no redundant experts; start it with --eplb-config",
                                status=400) from None

    add_pd_routes(app, server)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(server, body.model)
        params = body.to_params(server.defaults)
        prompts = [_Prompt(p, _encode(server, p, "prompt")) if isinstance(p, str)
                   else _Prompt(None, list(p)) for p in body.prompts()]
        fmt = _CompletionFormat(server, body, prompts, params)
        return await _respond(server, request, body, prompts, params, fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(server, body.model)
        params = body.to_params(server.defaults)
        text = _chat_text(server, body)
        prompts = [_Prompt(text, _encode(server, text, "messages", allow_special=True))]
        return await _respond(server, request, body, prompts, params, _ChatFormat(server, body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        _check_model(server, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ProtocolError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                         add_generation_prompt=body.add_generation_prompt)
            ids = _encode(server, _chat_text(server, chat), "messages", allow_special=True)
        else:
            ids = _encode(server, body.prompt, "prompt", allow_special=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.engine.info().max_model_len, "tokens": ids,
                "token_strs": [server.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(server, body.model)
        vocab = server.engine.info().vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise ProtocolError(f"token ids outside [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}

    return app


def _chat_text(server: Server, body: ChatCompletionRequest) -> str:
    try:
        return server.tokenizer.apply_chat_template(body.conversation(), body.add_generation_prompt)
    except ChatTemplateError as e:
        raise ProtocolError(str(e), param="messages") from None


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413, by its Content-Length before
    anything is read, or as soon as a body sent without one (chunked) passes the limit."""

    def __init__(self, app, server: Server):
        self.app, self.server, self.limit = app, server, server.max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _error(self.server, f"the request body has {length.decode(errors='replace')} bytes; this "
                                f"server takes at most {self.limit}", 413)(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # FastAPI passes an HTTPException from the body read on as it is
                raise HTTPException(413, f"the request body is over {self.limit} bytes, the most this server takes")
            return message
        return await self.app(scope, limited, send)


def _encode(server: Server, text: str, param: str, allow_special: bool = False) -> list[int]:
    try:
        return server.tokenizer.encode(text, allow_special=allow_special)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{param}: {e}", param=param) from None


def _error(server: Server, message: str, status: int, param: str | None = None) -> JSONResponse:
    server.metrics.rejected(status)
    return JSONResponse(error_body(message, status, param), status_code=status)


def _check_model(server: Server, model: str | None) -> None:
    if model is not None and model != server.model_name:
        raise ProtocolError(f"the model '{model}' does not exist; this server serves '{server.model_name}'",
                            status=404, param="model")


# ---- running requests --------------------------------------------------------------------------------------
async def _respond(server: Server, request: Request, body, prompts: list[_Prompt], params: SamplingParams, fmt):
    if params.n > server.max_n:
        raise ProtocolError(f"n={params.n} is more than this server allows ({server.max_n})", param="n")
    if params.structured_outputs is not None and not server.structured_output:
        raise ProtocolError("structured output is off on this server (--guided-decoding-backend off)",
                            param=params.structured_outputs.field)
    try:
        validate = functools.partial(check_requests, server.engine.validate, [p.ids for p in prompts],
                                     [params] * len(prompts))
        if params.structured_outputs is not None:  # compiling a grammar may take a while: not on the event loop
            await asyncio.to_thread(validate)
        else:
            validate()
    except RequestError as e:
        raise ProtocolError(str(e), param=e.param) from None
    if params.structured_outputs is not None:
        so = params.structured_outputs
        server.metrics.structured.labels(server.model_name, "tools" if so.field == "tools" else so.kind).inc()
    count = len(prompts) * params.n
    waiting = server.engine.stats().num_waiting
    if waiting + count > server.max_queue_len:
        raise ProtocolError(f"the server is busy ({waiting} requests waiting, limit "
                            f"{server.max_queue_len}); retry later", status=429)
    kv = body.kv_transfer_params
    pd = await server.pd.prepare(kv, [p.ids for p in prompts], params, server.engine)
    if pd.get("export_kv") and body.stream:
        raise ProtocolError("do_remote_decode answers are not streamed (stream must be false)", param="stream")
    request_id = f"{fmt.prefix}-{uuid.uuid4().hex}"
    streams = _add_requests(server, request_id, prompts, params, pd)
    outputs = _merge(server, streams)
    if body.stream:
        return StreamingResponse(_sse(fmt.stream(outputs, params)), media_type="text/event-stream")
    answer = await _cancel_on_disconnect(request, fmt.collect(outputs, params))
    if pd.get("export_kv") and isinstance(answer, dict):  # where the decode server finds the KV
        answer["kv_transfer_params"] = server.pd.exporter.describe(streams[0][0])
    return answer


def _add_requests(server: Server, request_id: str, prompts: list[_Prompt], params: SamplingParams,
                  pd: dict) -> list:
    """Every (prompt, sample) as its own engine request (SamplingParams.for_sample), queued now; pd: the
    engine's keyword arguments for prefill/decode across servers (serve/pd.py)."""
    streams = []
    try:
        for i, p in enumerate(prompts):
            for j, sample in enumerate(samples(params)):
                rid = f"{request_id}-{i}-{j}"
                streams.append((rid, server.engine.add_request(p.ids, sample, rid, p.text, **pd)))
    except (RequestError, EngineError) as e:
        for rid, _ in streams:
            server.engine.abort(rid)
        if isinstance(e, EngineError):  # the engine serves nothing more (/health says why)
            raise ProtocolError(str(e), status=503) from None
        raise ProtocolError(str(e), param=e.param) from None
    return streams


async def _merge(server: Server, streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (choice index, output snapshot) from all (request id, stream) pairs as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as e:  # noqa: BLE001 -- delivered to the consumer, which fails the response
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(k, s)) for k, (_, s) in enumerate(streams)]
    done: set[int] = set()
    try:
        while len(done) < len(tasks):
            index, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            if out.finished:
                done.add(index)
            yield index, out
    finally:  # a consumer that stops early (disconnect, error) aborts whatever is still running
        for k, t in enumerate(tasks):
            t.cancel()
            if k not in done:
                server.engine.abort(streams[k][0])


async def _cancel_on_disconnect(request: Request, coro):
    """Await `coro` unless the client goes away first; then cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)
    return task.result()


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    except (EngineError, RequestError) as e:
        yield f"data: {json.dumps(error_body(str(e), 500))}\n\n"
    except Exception as e:  # noqa: BLE001 -- the client gets an error event, not a cut-off stream
        log.exception("a streamed response failed")
        yield f"data: {json.dumps(error_body(f'internal error while streaming: {e!r}', 500))}\n\n"
    yield "data: [DONE]\n\n"


# ---- response formats ----------------------------------------------------------------------------------------
class _Choices:
    """Tracks what each choice has already sent, so a stream sends deltas. While a request with stop strings
    runs, the last len(longest stop) - 1 characters are held back: they may turn out to start a stop string,
    which is cut from the answer."""

    def __init__(self, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent_text: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}

    def delta(self, index: int, out: RequestOutput) -> tuple[str, list[dict]]:
        c = out.outputs[0]
        text = c.text or ""
        end = len(text) if out.finished else max(len(text) - self.hold, self.sent_text.get(index, 0))
        start, self.sent_text[index] = self.sent_text.get(index, 0), end
        lp_start, self.sent_tokens[index] = self.sent_tokens.get(index, 0), len(c.token_ids)
        return text[start:end], (c.logprobs or [])[lp_start:]


def _usage(prompts_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache (per prompt, the most
    any of its samples reused: the n samples of a prompt share its pages)."""
    return {"prompt_tokens": prompts_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompts_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached(outs: dict[int, RequestOutput] | list[RequestOutput], n: int) -> int:
    """Cached prompt tokens of a request's outputs (by choice index): the most per prompt, summed."""
    items = outs.items() if isinstance(outs, dict) else enumerate(outs)
    per_prompt: dict[int, int] = {}
    for index, out in items:
        per_prompt[index // n] = max(per_prompt.get(index // n, 0), out.num_cached_tokens)
    return sum(per_prompt.values())


class _Format:
    prefix = "cmpl"

    def __init__(self, server: Server, body):
        self.server, self.body, self.created = server, body, int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def token_text(self, token: int) -> str:
        return self.server.tokenizer.token_text(token)

    def envelope(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    async def collect(self, outputs, params: SamplingParams) -> dict:
        final: dict[int, RequestOutput] = {}
        try:
            async for index, out in outputs:
                if out.finished:
                    final[index] = out
        except EngineError as e:
            raise ProtocolError(str(e), status=500) from None
        return self.complete([final[i] for i in sorted(final)], params)

    async def stream(self, outputs, params: SamplingParams) -> AsyncIterator[dict]:
        choices = _Choices(params)
        opts = self.body.stream_options
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        latest: dict[int, RequestOutput] = {}
        async for index, out in outputs:
            latest[index] = out
            first = index not in choices.sent_tokens
            text, lps = choices.delta(index, out)
            prompt_tokens[index // params.n] = len(out.prompt_token_ids)
            completion_tokens[index] = len(out.outputs[0].token_ids)
            usage = _usage(sum(prompt_tokens.values()), sum(completion_tokens.values()), _cached(latest, params.n)) \
                if opts is not None and opts.continuous_usage_stats else None
            for chunk in self.chunks(index, out, text, lps, first):
                yield self.envelope(self.chunk_object, [chunk], usage)
        if opts is not None and opts.include_usage:
            yield self.envelope(self.chunk_object, [], _usage(sum(prompt_tokens.values()),
                                                              sum(completion_tokens.values()),
                                                              _cached(latest, params.n)))


class _CompletionFormat(_Format):
    prefix, chunk_object = "cmpl", "text_completion"

    def __init__(self, server: Server, body: CompletionRequest, prompts: list[_Prompt], params: SamplingParams):
        super().__init__(server, body)
        self.prompts, self.params = prompts, params
        self.echo_only = body.echo and body.max_tokens == 0  # score the prompt, generate nothing

    def _prompt_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.server.tokenizer.decode(p.ids)

    def _logprobs(self, entries: list[tuple[int, float | None, list | None]], offset: int) -> dict:
        """OpenAI's legacy completion logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, lps, tops, offsets = [], [], [], []
        for token, lp, top in entries:
            text = self.token_text(token)
            tokens.append(text)
            lps.append(lp)
            tops.append(None if top is None else {self.token_text(t): v for t, v in top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, index: int, out: RequestOutput, params: SamplingParams) -> dict:
        c = out.outputs[0]
        p = self.prompts[index // params.n]
        gen_lps, text = (c.logprobs or [], c.text or "") if not self.echo_only else ([], "")
        logprobs = None
        if params.logprobs is not None:
            entries = []
            if self.body.echo:
                prompt_lps = out.prompt_logprobs or [None] * len(p.ids)
                entries += [(t, None if e is None else e["logprob"], None if e is None else e["top"])
                            for t, e in zip(p.ids, prompt_lps)]
            entries += [(e["token"], e["logprob"], e["top"]) for e in gen_lps]
            logprobs = self._logprobs(entries, 0)
        if self.body.echo:
            text = self._prompt_text(p) + text
        finish = "length" if self.echo_only else c.finish_reason
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": None if self.echo_only else c.stop_reason}

    def complete(self, outs: list[RequestOutput], params: SamplingParams) -> dict:
        choices = [self._choice(i, out, params) for i, out in enumerate(outs)]
        prompt_tokens = sum(len(p.ids) for p in self.prompts)
        completion_tokens = 0 if self.echo_only else sum(len(o.outputs[0].token_ids) for o in outs)
        return self.envelope("text_completion", choices, _usage(prompt_tokens, completion_tokens,
                                                                _cached(outs, params.n)))

    def chunks(self, index: int, out: RequestOutput, text: str, lps: list[dict], first: bool) -> list[dict]:
        if self.echo_only:  # the prompt alone, once
            return [self._choice(index, out, self.params)] if out.finished else []
        if first and self.body.echo:
            text = self._prompt_text(self.prompts[index // self.body.n]) + text
        logprobs = None if self.body.logprobs is None else self._logprobs(
            [(e["token"], e["logprob"], e["top"]) for e in lps], 0)
        c = out.outputs[0]
        return [{"index": index, "text": text, "logprobs": logprobs,
                 "finish_reason": c.finish_reason if out.finished else None,
                 "stop_reason": c.stop_reason if out.finished else None}]


class _ChatFormat(_Format):
    """Chat answers; with tools (tool_choice other than "none") the text's `<tool_call>` blocks become
    tool_calls, with a reasoning parser the text before `</think>` becomes reasoning_content."""
    prefix, chunk_object = "chatcmpl", "chat.completion.chunk"

    def __init__(self, server: Server, body: ChatCompletionRequest):
        super().__init__(server, body)
        self.tools = body.tool_mode() is not None
        self.reasoning = server.reasoning_parser is not None
        self._splitters: dict[int, reasoning.StreamSplitter] = {}
        self._parsers: dict[int, tool_calls.StreamParser] = {}

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning:
            message["reasoning_content"], message["content"] = reasoning.split(text)
        if self.tools:
            message["content"], calls = tool_calls.parse(message["content"] or "")
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    def _logprobs(self, lps: list[dict]) -> dict:
        def entry(token, lp):
            return {"token": self.token_text(token), "logprob": lp,
                    "bytes": list(self.server.tokenizer.token_bytes(token))}
        return {"content": [{**entry(e["token"], e["logprob"]), "top_logprobs": [entry(t, v) for t, v in e["top"]]}
                            for e in lps]}

    def complete(self, outs: list[RequestOutput], params: SamplingParams) -> dict:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            message, finish = self._message(c.text or "", c.finish_reason)
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(c.logprobs) if params.logprobs is not None else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        prompt_tokens = len(outs[0].prompt_token_ids)
        return self.envelope("chat.completion", choices,
                             _usage(prompt_tokens, sum(len(o.outputs[0].token_ids) for o in outs),
                                    _cached(outs, params.n)))

    def chunks(self, index: int, out: RequestOutput, text: str, lps: list[dict], first: bool) -> list[dict]:
        logprobs = self._logprobs(lps) if self.body.logprobs else None
        out_chunks = []
        if first:
            out_chunks.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None})
        delta = self._delta(index, text, out.finished)
        if delta or lps:
            out_chunks.append({"index": index, "delta": delta or {"content": ""}, "logprobs": logprobs,
                               "finish_reason": None})
        if out.finished:
            c = out.outputs[0]
            called = index in self._parsers and self._parsers[index].calls > 0
            out_chunks.append({"index": index, "delta": {}, "logprobs": None,
                               "finish_reason": "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason,
                               "stop_reason": c.stop_reason})
        return out_chunks

    def _delta(self, index: int, text: str, final: bool) -> dict:
        """A text delta as a chat delta: content, or reasoning_content and tool_calls where they apply."""
        if not (self.reasoning or self.tools):
            return {"content": text} if text else {}
        think = ""
        if self.reasoning:
            think, text = self._splitters.setdefault(index, reasoning.StreamSplitter()).feed(text, final)
        calls = []
        if self.tools:
            text, calls = self._parsers.setdefault(index, tool_calls.StreamParser()).feed(text, final)
        delta: dict[str, Any] = {}
        if think:
            delta["reasoning_content"] = think
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return delta
