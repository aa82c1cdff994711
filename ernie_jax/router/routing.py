"""The router's decisions: which servers are up, which server a request goes to, and the PD split between a
prefill and a decode server (the routes and the command line: router/app.py).

`python -m ernie_jax.router --prefill URL... --decode URL... [--mixed URL...]` (SGLang's
`--pd-disaggregation --prefill/--decode`, FastDeploy's router). At start it asks every server for its role,
model and KV layout (`/v1/pd/info`) and refuses a server whose role differs from its flag, or a prefill and a
decode server whose KV layouts differ, naming the mismatch.

A completion or chat request with one prompt and n = 1 goes to a prefill server (by cache affinity: the
server that last prefilled a prompt with the same beginning, unless it has `AFFINITY_SLACK` more requests in
flight than the least busy one; else the least busy) with `kv_transfer_params: {"do_remote_decode": true}` and
max_tokens 1; its answer names where the prompt's KV is, and the original request goes to a decode server
(fewest in flight) with those parameters and the prefill server's URL; the decode server's answer, streamed
or not, is passed through as it arrives. When the first token already ended the request (the prefill server
kept no KV) the whole request goes to the decode server. A request with n > 1 or several prompts is sent as
one such request per prompt and sample, and their answers merged (router/fanout.py). Requests for the prompt's
logprobs or its echo go whole to a mixed server, or to a decode server: role servers are complete engines.
Errors of a server are passed through unchanged; a server that does not answer is a 502 naming it.

With `--pd-policy dynamic` the router switches roles across servers by the PD policy of one server
(`whole_on`, over each server's published load, /v1/pd/load): a decode server prefills prompts whole while the
prefill server is busy, a prefill server decodes what it prefills while it is idle.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ernie_jax.engine.policy import InstanceView, PDPolicy
from ernie_jax.router.fanout import fan_out, merge
from ernie_jax.serve.protocol import MAX_PROMPTS

log = logging.getLogger("ernie_jax.router")

PREFIX_IDS, PREFIX_CHARS = 64, 256  # what of a prompt names its beginning for cache affinity (a few KV pages)
AFFINITY_SLACK = 2  # requests in flight a prefill server may have over the least busy one and keep its prefixes
AFFINITY_ENTRIES = 10_000  # prompt beginnings remembered, least recently used dropped first


def prefix_key(body: dict) -> str | None:
    """A hash of the beginning of a request's prompt (token ids, text, or chat messages), or None when the body
    has none the router can read (the server then answers for it)."""
    prompt = body.get("prompt") if "messages" not in body else body.get("messages")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        material = json.dumps(prompt[:PREFIX_IDS])
    elif isinstance(prompt, str):
        material = prompt[:PREFIX_CHARS]
    elif isinstance(prompt, list):  # chat messages
        material = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)[:PREFIX_CHARS]
    else:
        return None
    return hashlib.sha256(material.encode()).hexdigest()


def whole_on(policy: PDPolicy, prefill: InstanceView, waiting: int, decode: InstanceView) -> str | None:
    """Role switching across servers with the rules of one server's PD policy (engine/policy.py), for a new
    request: "decode" when the decode server takes the prompt whole (the prefill server is busy prefilling,
    `waiting` prompts are queued there, and the decode server's batch has room: admit_seats), "prefill" when
    the prefill server keeps it whole (it has nothing else to prefill and decoding it there keeps the two
    batches even: handover_count 0), None to split it (prefill there, decode here)."""
    pv, dv = dataclasses.replace(prefill, home="prefill"), dataclasses.replace(decode, home="decode")
    if policy.admit_seats(dv, waiting + 1, pv) > 0:
        return "decode"
    if policy.handover_count(dataclasses.replace(pv, running=pv.running + 1), waiting, dv) == 0:
        return "prefill"
    return None


class RouterError(RuntimeError):
    """A server the router was given cannot be used; the message names it and why."""


class _Unreachable(Exception):
    """A server did not answer (nothing was sent to the client yet)."""


class _Upstream:
    """A server's open stream, counted in flight on its server until closed (once), whether relayed to its end
    or dropped unread."""

    def __init__(self, backend: "Backend", response: httpx.Response):
        self.backend, self.response, self.open = backend, response, True
        backend.in_flight += 1

    async def close(self) -> None:
        if self.open:
            self.open = False
            self.backend.in_flight -= 1
            await self.response.aclose()


class Backend:
    def __init__(self, url: str, role: str, registered: bool = False):
        self.url, self.role, self.registered = url.rstrip("/"), role, registered
        self.in_flight = 0
        self.routed = 0
        self.failures = 0
        self.info: dict = {}
        self.up = True
        self.draining = False  # a role switch is under way: not routed to
        self.misses = 0  # heartbeats missed in a row
        self.last_seen = time.monotonic()

    def seen(self) -> None:
        if not self.up:
            log.info("%s server %s is back", self.role, self.url)
        self.up, self.misses, self.last_seen = True, 0, time.monotonic()

    def missed(self, why: str, at_once: bool = False) -> None:
        """A heartbeat or a request it did not answer; at_once: it refused the connection (down now)."""
        self.misses = max(self.misses + 1, 2 if at_once else 0)
        if self.up and self.misses >= 2:
            self.up = False
            log.warning("%s server %s is down (%s): not routed to until it answers again", self.role, self.url, why)


class Router:
    def __init__(self, prefill: list[str], decode: list[str], mixed: list[str], api_key: str | None = None,
                 timeout: float = 600.0, heartbeat: float = 5.0, policy: PDPolicy = PDPolicy("static")):
        self.backends = [Backend(u, "prefill") for u in prefill] + [Backend(u, "decode") for u in decode] + \
            [Backend(u, "mixed") for u in mixed]
        self.api_key, self.timeout, self.heartbeat, self.policy = api_key, timeout, heartbeat, policy
        self.pd_requests: collections.Counter = collections.Counter()  # (prefilled on, decoded on) -> requests
        self.counts: collections.Counter = collections.Counter()  # routing decisions
        self.seconds: collections.Counter = collections.Counter()  # prefill-leg seconds
        self.client: httpx.AsyncClient | None = None
        self.prefixes: collections.OrderedDict[str, str] = collections.OrderedDict()  # prefix key -> prefill URL

    def of(self, role: str) -> list[Backend]:
        """The servers of a role that are up."""
        return [b for b in self.backends if b.role == role and b.up and not b.draining]

    def check(self) -> None:
        """Each server's role and KV layout, read from /v1/pd/info (RouterError naming the mismatch)."""
        for b in self.backends:
            try:
                r = httpx.get(b.url + "/v1/pd/info", headers=self._headers(None), timeout=10)
            except httpx.HTTPError as e:
                raise RouterError(f"{b.role} server {b.url} does not answer: {e!r}") from None
            self._admit(b, r)

    def _admit(self, b: Backend, r: httpx.Response) -> None:
        """b's /v1/pd/info answer checked against its role and the other servers (RouterError naming why)."""
        if r.status_code != 200:
            raise RouterError(f"{b.role} server {b.url}: /v1/pd/info answered {r.status_code} {r.text[:200]}")
        info = r.json()
        if info.get("role") != b.role:
            raise RouterError(f"{b.url} serves as {info.get('role')!r}, not as {b.role!r} (its --pd-role)")
        for other in self.backends:
            if other is b or not other.info:
                continue
            if other.info.get("model") != info.get("model"):
                raise RouterError(f"{b.url} serves {info.get('model')!r}, {other.url} serves "
                                  f"{other.info.get('model')!r}")
            theirs, mine = _transferable(other.info.get("kv_layout")), _transferable(info.get("kv_layout"))
            if b.role != "mixed" and other.role != "mixed" and theirs != mine:
                raise RouterError(f"{b.url} keeps its KV in another layout than {other.url} (model, block size, KV "
                                  f"dtype or MTP differ): {_layout_diff(theirs, mine)}")
        b.info = info

    async def register(self, url: Any, role: Any) -> dict:
        """A server announcing itself (and its heartbeat): added, or marked up again."""
        if role not in ("prefill", "decode", "mixed") or not isinstance(url, str) or not url.startswith("http"):
            raise RouterError(f"register needs a role (prefill, decode or mixed) and an http URL; got role {role!r}, "
                              f"url {url!r}")
        b = next((x for x in self.backends if x.url == url.rstrip("/")), None)
        if b is not None and b.role == role and b.up:
            b.seen()
            return {"registered": b.url, "role": role, "new": False, "heartbeat": self.heartbeat}
        candidate = Backend(url, role, registered=True)
        try:
            r = await self.client.get(candidate.url + "/v1/pd/info", headers=self._headers(None), timeout=10)
        except httpx.HTTPError as e:
            raise RouterError(f"{url} registered as {role} but does not answer: {e!r}") from None
        if b is not None:  # down, or restarted with another role: checked again, as a new server
            self.backends.remove(b)
        try:
            self._admit(candidate, r)
        except RouterError:
            if b is not None:
                self.backends.append(b)
            raise
        self.backends.append(candidate)
        log.info("%s server %s registered", role, candidate.url)
        return {"registered": candidate.url, "role": role, "new": True, "heartbeat": self.heartbeat}

    async def switch_role(self, url: Any, role: Any, timeout: float, headers: dict) -> Response:
        """POST /pd_role_switch: stop routing to the server, have it drain and change its role, route to it in
        its new role (its answer passed through when it refuses)."""
        b = next((x for x in self.backends if isinstance(url, str) and x.url == url.rstrip("/")), None)
        if b is None:
            return error_response(f"no server {url!r} behind this router (known: {[x.url for x in self.backends]})",
                                  404)
        b.draining = True
        try:
            r = await self.client.post(b.url + "/pd_role_switch", json={"role": role, "timeout": timeout},
                                       headers=headers, timeout=timeout + 30)
            if r.status_code == 200:
                b.role = role
                info = await self.client.get(b.url + "/v1/pd/info", headers=headers, timeout=10)
                try:
                    self._admit(b, info)
                except RouterError as e:
                    b.up = False
                    return error_response(f"{b.url} switched to {role} but cannot serve beside the others: {e}", 409)
                self.counts[f"role_switch_to_{role}"] += 1
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        except httpx.HTTPError as e:
            return error_response(f"{b.url} did not answer the role switch: {e!r}", 502)
        finally:
            b.draining = False

    async def watch(self) -> None:
        """Every heartbeat: a server given on the command line is asked for /health; a registered one must
        have registered again within two heartbeats. Two misses mark a server down; an answer marks it up."""
        while True:
            await asyncio.sleep(self.heartbeat)
            for b in list(self.backends):
                if b.registered:  # two heartbeats of silence are two misses
                    if time.monotonic() - b.last_seen > 2 * self.heartbeat:
                        b.missed(f"no heartbeat for {time.monotonic() - b.last_seen:.0f} s", at_once=True)
                    continue
                try:
                    ok = (await self.client.get(b.url + "/health", timeout=self.heartbeat)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                b.seen() if ok else b.missed("/health did not answer 200")

    def _headers(self, request: Request | None) -> dict:
        auth = request.headers.get("authorization") if request is not None else None
        if auth is None and self.api_key:
            auth = f"Bearer {self.api_key}"
        return {"Authorization": auth} if auth else {}

    @staticmethod
    def pick(backends: list[Backend]) -> Backend:
        return min(backends, key=lambda b: (b.in_flight, b.routed))

    def pick_prefill(self, backends: list[Backend], key: str | None) -> Backend:
        """The prefill server for a request whose prompt begins as `key` (prefix_key) says: the one that last
        prefilled a prompt beginning so (its prefix cache likely holds those pages) unless it has more than
        AFFINITY_SLACK requests in flight over the least busy one, else the least busy."""
        least = self.pick(backends)
        last = next((b for b in backends if b.url == self.prefixes.get(key)), None)
        if last is not None and last.in_flight <= least.in_flight + AFFINITY_SLACK:
            self.counts["prefill_affinity"] += 1
            return last
        return least

    def prefilled_on(self, b: Backend, key: str | None) -> None:
        """Remember that prefill server b prefills a prompt beginning as `key` says (for pick_prefill)."""
        if key is not None:
            self.prefixes[key] = b.url
            self.prefixes.move_to_end(key)
            while len(self.prefixes) > AFFINITY_ENTRIES:
                self.prefixes.popitem(last=False)

    async def route(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response("the request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        headers = self._headers(request)
        if not any(b.up for b in self.backends):
            return error_response("no server is up behind this router", 503)
        prefill, decode = self.of("prefill"), self.of("decode")
        if prefill and decode and (parts := fan_out(
                path, body, min(b.info.get("max_n", 1) for b in prefill + decode), MAX_PROMPTS)) is not None:
            self.counts["fanned_out"] += 1
            answers = await asyncio.gather(*(self._route_one(path, part, headers) for part in parts),
                                           return_exceptions=True)
            return await merge(answers, body.get("n", 1), bool(body.get("stream")))
        return await self._route_one(path, body, headers)

    async def _route_one(self, path: str, body: dict, headers: dict) -> Response:
        """A request split between a prefill and a decode server where it can be, else sent whole."""
        split = (self.of("prefill") and self.of("decode") and body.get("n", 1) == 1
                 and not body.get("echo") and body.get("prompt_logprobs") is None
                 and (path.endswith("chat/completions") or isinstance(body.get("prompt"), str)
                      or (isinstance(body.get("prompt"), list) and body["prompt"]
                          and isinstance(body["prompt"][0], int))))
        if not split:  # role servers are whole engines: with one side down, the other serves whole requests
            whole = self.of("mixed") or self.of("decode") or self.of("prefill")
            self.counts["whole"] += 1
            return await self._send(self.pick(whole), path, body, headers)
        key = prefix_key(body)
        prefill, decode = self.pick_prefill(self.of("prefill"), key), self.pick(self.of("decode"))
        if self.policy.mode == "dynamic" and (server := await self._switch(prefill, decode)) is not None:
            self.pd_requests[server.url, server.url] += 1
            if server is prefill:
                self.prefilled_on(prefill, key)
            return await self._send(server, path, body, headers)
        self.prefilled_on(prefill, key)
        first = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        t0 = time.perf_counter()
        prefill.in_flight += 1
        try:
            r = await self.client.post(prefill.url + path, json=first, headers=headers)
        except httpx.HTTPError as e:
            prefill.failures += 1
            prefill.missed(repr(e), at_once=isinstance(e, httpx.ConnectError))
            rest = self.of("decode") or self.of("mixed") or self.of("prefill")
            if isinstance(e, httpx.ConnectError) and rest:  # nothing was computed: served whole elsewhere
                self.counts["rerouted"] += 1
                return await self._send(self.pick(rest), path, body, headers)
            return error_response(f"the prefill server {prefill.url} did not answer: {e!r}", 502)
        finally:
            prefill.in_flight -= 1
        prefill.routed += 1
        self.seconds["prefill"] += time.perf_counter() - t0
        if r.status_code != 200:  # the request's own error, as the server said it
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        kv = r.json().get("kv_transfer_params")
        if not kv:  # its first token ended it there: nothing to continue from
            self.counts["whole"] += 1
            return await self._send(decode, path, body, headers)
        self.counts["split"] += 1
        self.pd_requests[prefill.url, decode.url] += 1
        second = {**body, "kv_transfer_params": {**kv, "remote_url": prefill.url}}
        try:
            return await self._forward(decode, path, second, headers)
        except _Unreachable as e:
            rest = self.of("decode") or self.of("mixed") or self.of("prefill")
            if not rest:
                return error_response(str(e), 502)
            # nothing reached the client: served whole elsewhere (the prefill server's copy of the KV expires)
            self.counts["rerouted"] += 1
            return await self._send(self.pick(rest), path, body, headers)

    async def _load(self, b: Backend) -> tuple[InstanceView, int] | None:
        try:
            r = await self.client.get(b.url + "/v1/pd/load", headers=self._headers(None), timeout=5)
            d = r.json()
            return InstanceView(**d["view"]), int(d["waiting"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def _switch(self, prefill: Backend, decode: Backend) -> Backend | None:
        """The server that takes a request whole under the dynamic policy (whole_on), or None (split). The
        router's own requests in flight to a server count as work it has (its published load lags)."""
        loads = await asyncio.gather(self._load(prefill), self._load(decode))
        if None in loads:
            return None
        (pv, waiting), (dv, _) = loads
        pv = dataclasses.replace(pv, prefilling=max(pv.prefilling, prefill.in_flight))
        dv = dataclasses.replace(dv, running=max(dv.running, decode.in_flight - dv.prefilling))
        side = whole_on(self.policy, pv, waiting + prefill.in_flight, dv)
        return {"prefill": prefill, "decode": decode, None: None}[side]

    async def _send(self, b: Backend, path: str, body: dict, headers: dict) -> Response:
        try:
            return await self._forward(b, path, body, headers)
        except _Unreachable as e:
            return error_response(str(e), 502)

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
                    b.missed(repr(e), at_once=isinstance(e, httpx.ConnectError))
                    raise _Unreachable(f"the {b.role} server {b.url} did not answer: {e!r}") from None
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            req = self.client.build_request("POST", b.url + path, json=body, headers=headers)
            try:
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                b.failures += 1
                b.missed(repr(e), at_once=isinstance(e, httpx.ConnectError))
                raise _Unreachable(f"the {b.role} server {b.url} did not answer: {e!r}") from None
            if r.status_code != 200:
                content = await r.aread()
                await r.aclose()
                return Response(content, status_code=r.status_code, media_type="application/json")
            up = _Upstream(b, r)  # in flight until the stream ends
            answer = StreamingResponse(self._relay(up), media_type="text/event-stream")
            answer.upstream = up  # a merged answer (fanout.py) closes the parts it does not relay
            return answer
        finally:
            b.in_flight -= 1

    @staticmethod
    async def _relay(up: _Upstream):
        b = up.backend
        try:
            async for chunk in up.response.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the server went away mid-stream: the client gets an error event
            b.failures += 1
            b.missed(repr(e))
            error = {"error": {"message": f"the {b.role} server {b.url} failed mid-stream: {e!r}",
                               "type": "server_error", "code": 502}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await up.close()

    def metrics(self) -> str:
        lines = []
        for b in self.backends:
            label = f'url="{b.url}",role="{b.role}"'
            lines += [f"ernie_jax_router:up{{{label}}} {int(b.up)}",
                      f"ernie_jax_router:in_flight{{{label}}} {b.in_flight}",
                      f"ernie_jax_router:routed_total{{{label}}} {b.routed}",
                      f"ernie_jax_router:failures_total{{{label}}} {b.failures}"]
        lines += [f'ernie_jax_router:requests_total{{path="{k}"}} {v}' for k, v in sorted(self.counts.items())]
        lines.append(f"ernie_jax_router:prefill_seconds_total {self.seconds['prefill']:.6f}")
        lines += [f'ernie_jax_router:pd_requests_total{{prefill="{p}",decode="{d}"}} {n}'
                  for (p, d), n in sorted(self.pd_requests.items())]
        return "\n".join(lines) + "\n"


def _transferable(layout: dict | None) -> dict | None:
    """What of a KV layout two servers must share for one to take the other's pages: not how the pages lie on
    the devices (`shards`: pages cross between unlike meshes too, on one device; engine/kv_connector.py)."""
    return None if layout is None else {k: v for k, v in layout.items() if k != "shards"}


def _layout_diff(a: dict | None, b: dict | None) -> str:
    if a is None or b is None:
        return "one of them keeps no KV for transfer"
    return "; ".join(f"{k}: {a.get(k)!r} against {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k))[:500]


def error_response(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                   "server_error", "param": None, "code": status}}, status_code=status)
