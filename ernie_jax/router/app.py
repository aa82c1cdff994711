"""The router: one OpenAI-compatible endpoint in front of prefill, decode and mixed servers.

`python -m ernie_jax.router --prefill URL... --decode URL... [--mixed URL...]` (SGLang's
`--pd-disaggregation --prefill/--decode`, FastDeploy's router). At start it asks every server for its role,
model and KV layout (`/v1/pd/info`) and refuses a server whose role differs from its flag, or a prefill and a
decode server whose KV layouts differ, naming the mismatch.

A completion or chat request with one prompt and n = 1 goes to a prefill server (the one with the fewest
requests the router has in flight there) with `kv_transfer_params: {"do_remote_decode": true}` and
max_tokens 1; its answer names where the prompt's KV is, and the original request goes to a decode server
(fewest in flight) with those parameters and the prefill server's URL; the decode server's answer, streamed
or not, is passed through as it arrives. When the first token already ended the request (the prefill server
kept no KV) the whole request goes to the decode server. Other requests (several prompts, n > 1, prompt
logprobs) go whole to a mixed server, or to a decode server: role servers are complete engines. Errors of a
server are passed through unchanged; a server that does not answer is a 502 naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("ernie_jax.router")


class RouterError(RuntimeError):
    """A server the router was given cannot be used; the message names it and why."""


class Backend:
    def __init__(self, url: str, role: str):
        self.url, self.role = url.rstrip("/"), role
        self.in_flight = 0
        self.routed = 0
        self.failures = 0
        self.info: dict = {}


class Router:
    def __init__(self, prefill: list[str], decode: list[str], mixed: list[str], api_key: str | None = None,
                 timeout: float = 600.0):
        self.backends = [Backend(u, "prefill") for u in prefill] + [Backend(u, "decode") for u in decode] + \
            [Backend(u, "mixed") for u in mixed]
        self.api_key, self.timeout = api_key, timeout
        self.counts: collections.Counter = collections.Counter()  # routing decisions
        self.seconds: collections.Counter = collections.Counter()  # prefill-leg seconds
        self.client: httpx.AsyncClient | None = None

    def of(self, role: str) -> list[Backend]:
        return [b for b in self.backends if b.role == role]

    def check(self) -> None:
        """Each server's role and KV layout, read from /v1/pd/info (RouterError naming the mismatch)."""
        if not (self.of("prefill") and self.of("decode")) and not self.of("mixed"):
            raise RouterError("give at least one --prefill and one --decode server, or a --mixed one")
        headers = self._headers(None)
        for b in self.backends:
            try:
                r = httpx.get(b.url + "/v1/pd/info", headers=headers, timeout=10)
            except httpx.HTTPError as e:
                raise RouterError(f"{b.role} server {b.url} does not answer: {e!r}") from None
            if r.status_code != 200:
                raise RouterError(f"{b.role} server {b.url}: /v1/pd/info answered {r.status_code} {r.text[:200]}")
            b.info = r.json()
            if b.info.get("role") != b.role:
                raise RouterError(f"{b.url} serves as {b.info.get('role')!r}, not as {b.role!r} (its --pd-role)")
        layouts = {b.url: b.info.get("kv_layout") for b in self.of("prefill") + self.of("decode")}
        first = next(iter(layouts.items()), None)
        for url, layout in layouts.items():
            if layout != first[1]:
                raise RouterError(f"{url} keeps its KV in another layout than {first[0]} (model, block size, KV "
                                  f"dtype or MTP differ): {_layout_diff(first[1], layout)}")
        models = {b.info.get("model") for b in self.backends}
        if len(models) > 1:
            raise RouterError(f"the servers serve different models: {sorted(map(str, models))}")

    def _headers(self, request: Request | None) -> dict:
        auth = request.headers.get("authorization") if request is not None else None
        if auth is None and self.api_key:
            auth = f"Bearer {self.api_key}"
        return {"Authorization": auth} if auth else {}

    @staticmethod
    def pick(backends: list[Backend]) -> Backend:
        return min(backends, key=lambda b: (b.in_flight, b.routed))

    async def route(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return _error("the request body must be a JSON object", 400)
        headers = self._headers(request)
        split = (self.of("prefill") and self.of("decode") and body.get("n", 1) == 1
                 and not body.get("echo") and not body.get("prompt_logprobs")
                 and (path.endswith("chat/completions") or isinstance(body.get("prompt"), str)
                      or (isinstance(body.get("prompt"), list) and body["prompt"]
                          and isinstance(body["prompt"][0], int))))
        if not split:
            whole = self.of("mixed") or self.of("decode")
            self.counts["whole"] += 1
            return await self._forward(self.pick(whole), path, body, headers)
        prefill, decode = self.pick(self.of("prefill")), self.pick(self.of("decode"))
        first = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        t0 = time.perf_counter()
        prefill.in_flight += 1
        try:
            r = await self.client.post(prefill.url + path, json=first, headers=headers)
        except httpx.HTTPError as e:
            prefill.failures += 1
            return _error(f"the prefill server {prefill.url} did not answer: {e!r}", 502)
        finally:
            prefill.in_flight -= 1
        prefill.routed += 1
        self.seconds["prefill"] += time.perf_counter() - t0
        if r.status_code != 200:  # the request's own error, as the server said it
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        kv = r.json().get("kv_transfer_params")
        if not kv:  # its first token ended it there: nothing to continue from
            self.counts["whole"] += 1
            return await self._forward(decode, path, body, headers)
        self.counts["split"] += 1
        second = {**body, "kv_transfer_params": {**kv, "remote_url": prefill.url}}
        return await self._forward(decode, path, second, headers)

    async def _forward(self, b: Backend, path: str, body: dict, headers: dict) -> Response:
        """body to server b; its answer passed through (streamed as it arrives when body asks to stream)."""
        b.in_flight += 1
        b.routed += 1
        try:
            if not body.get("stream"):
                try:
                    r = await self.client.post(b.url + path, json=body, headers=headers)
                except httpx.HTTPError as e:
                    b.failures += 1
                    return _error(f"the {b.role} server {b.url} did not answer: {e!r}", 502)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            req = self.client.build_request("POST", b.url + path, json=body, headers=headers)
            try:
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                b.failures += 1
                return _error(f"the {b.role} server {b.url} did not answer: {e!r}", 502)
            if r.status_code != 200:
                content = await r.aread()
                await r.aclose()
                return Response(content, status_code=r.status_code, media_type="application/json")
            b.in_flight += 1  # held until the stream ends
            return StreamingResponse(self._relay(b, r), media_type="text/event-stream")
        finally:
            b.in_flight -= 1

    async def _relay(self, b: Backend, r: httpx.Response):
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the server went away mid-stream: the client gets an error event
            b.failures += 1
            error = {"error": {"message": f"the {b.role} server {b.url} failed mid-stream: {e!r}",
                               "type": "server_error", "code": 502}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            b.in_flight -= 1
            await r.aclose()

    def metrics(self) -> str:
        lines = []
        for b in self.backends:
            label = f'url="{b.url}",role="{b.role}"'
            lines += [f"ernie_jax_router:in_flight{{{label}}} {b.in_flight}",
                      f"ernie_jax_router:routed_total{{{label}}} {b.routed}",
                      f"ernie_jax_router:failures_total{{{label}}} {b.failures}"]
        lines += [f'ernie_jax_router:requests_total{{path="{k}"}} {v}' for k, v in sorted(self.counts.items())]
        lines.append(f"ernie_jax_router:prefill_seconds_total {self.seconds['prefill']:.6f}")
        return "\n".join(lines) + "\n"


def _layout_diff(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return "one of them keeps no KV for transfer"
    return "; ".join(f"{k}: {a.get(k)!r} against {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k))[:500]


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": None, "code": status}}, status_code=status)


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="ernie_jax router", docs_url=None, redoc_url=None)

    @app.on_event("startup")
    async def _start():
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(router.timeout, connect=10))

    @app.on_event("shutdown")
    async def _stop():
        await router.client.aclose()

    @app.get("/health")
    async def health() -> Response:
        async def ok(b: Backend) -> bool:
            try:
                return (await router.client.get(b.url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False
        alive = await asyncio.gather(*(ok(b) for b in router.backends))
        up = {b.role for b, a in zip(router.backends, alive) if a}
        if not ({"prefill", "decode"} <= up or "mixed" in up):
            down = [b.url for b, a in zip(router.backends, alive) if not a]
            return _error(f"no complete set of servers is up (down: {down})", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        b = (router.of("decode") + router.of("mixed"))[0]
        r = await router.client.get(b.url + "/v1/models", headers=router._headers(request))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route("/v1/chat/completions", request)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.router", description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="servers started with --pd-role prefill")
    ap.add_argument("--decode", nargs="*", default=[], metavar="URL", help="servers started with --pd-role decode")
    ap.add_argument("--mixed", nargs="*", default=[], metavar="URL", help="servers that serve whole requests")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="sent to the servers when a client sends none")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to answer")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.prefill, args.decode, args.mixed, args.api_key, args.timeout)
    try:
        router.check()
    except RouterError as e:
        raise SystemExit(f"error: {e}") from None
    log.info("routing: prefill %s, decode %s, mixed %s", args.prefill, args.decode, args.mixed)
    config = uvicorn.Config(create_app(router), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
