"""`python -m ernie_jax.router`: the router's HTTP routes (OpenAI's, /health, /metrics, /register) and its
command line; what it decides is router/routing.py."""

from __future__ import annotations

import argparse
import asyncio
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ernie_jax.engine.policy import PDPolicy
from ernie_jax.router.routing import Router, RouterError, error_response

log = logging.getLogger("ernie_jax.router")


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="ernie_jax router", docs_url=None, redoc_url=None)

    @app.on_event("startup")
    async def _start():
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(router.timeout, connect=10))
        app.state.watch = asyncio.create_task(router.watch())

    @app.post("/register")
    async def register(request: Request) -> Response:
        """A server announces itself (`--router URL` on the server), and again every heartbeat."""
        try:
            body = await request.json()
            return JSONResponse(await router.register(body.get("url"), body.get("role")))
        except (ValueError, AttributeError):
            return error_response("register needs a JSON object {\"url\": ..., \"role\": ...}", 400)
        except RouterError as e:
            return error_response(str(e), 400)

    @app.on_event("shutdown")
    async def _stop():
        await router.client.aclose()

    @app.post("/pd_role_switch")
    async def pd_role_switch(request: Request) -> Response:
        """Drain a server and change its role: {"url": ..., "role": "prefill" | "decode" | "mixed", "timeout": s}."""
        try:
            body = await request.json()
            url, role, timeout = body.get("url"), body.get("role"), float(body.get("timeout", 60))
        except (ValueError, AttributeError, TypeError):
            return error_response('the body must be a JSON object {"url": ..., "role": ..., "timeout": seconds}', 400)
        return await router.switch_role(url, role, timeout, router._headers(request))

    @app.get("/health")
    async def health() -> Response:
        """200 while some server is up (with one role down, the other serves whole requests)."""
        if not any(b.up for b in router.backends):
            return error_response(f"no server is up (known: {[b.url for b in router.backends]})", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        up = router.of("decode") + router.of("mixed") + router.of("prefill")
        if not up:
            return error_response("no server is up behind this router", 503)
        try:
            r = await router.client.get(up[0].url + "/v1/models", headers=router._headers(request))
        except httpx.HTTPError as e:
            return error_response(f"{up[0].url} did not answer: {e!r}", 502)
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
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.router", description="The router in front of prefill, decode and mixed servers.")
    ap.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="servers started with --pd-role prefill")
    ap.add_argument("--decode", nargs="*", default=[], metavar="URL", help="servers started with --pd-role decode")
    ap.add_argument("--mixed", nargs="*", default=[], metavar="URL", help="servers that serve whole requests")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="sent to the servers when a client sends none")
    ap.add_argument("--pd-policy", default="static", choices=["static", "dynamic"],
                    help="static: every request is split between a prefill and a decode server; dynamic: the PD "
                         "policy of one server across servers (a decode server prefills prompts whole while the "
                         "prefill servers are busy, a prefill server decodes what it prefilled while it is idle)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to answer")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="seconds between health checks (servers that "
                    "register themselves send theirs); two missed mark a server down")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    router = Router(args.prefill, args.decode, args.mixed, args.api_key, args.timeout, args.heartbeat,
                    PDPolicy(args.pd_policy))
    try:
        router.check()
    except RouterError as e:
        raise SystemExit(f"error: {e}") from None
    log.info("routing: prefill %s, decode %s, mixed %s%s", args.prefill, args.decode, args.mixed,
             "" if router.backends else " (none yet: servers register with --router)")
    if bool(args.prefill) != bool(args.decode):
        have, lack = ("prefill", "decode") if args.prefill else ("decode", "prefill")
        log.warning("%s servers and no %s server: requests are served whole, not split, until a %s server registers",
                    have, lack, lack)
    config = uvicorn.Config(create_app(router), host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False)
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
