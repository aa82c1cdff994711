"""A server's part in prefill/decode disaggregation across processes (the protocol: engine/kv_connector.py).

`--pd-role prefill` servers export a prompt's KV for a request whose `kv_transfer_params` say
`do_remote_decode`; `--pd-role decode` servers take a request whose parameters say `do_remote_prefill`, pull its
KV from the prefill server named by `remote_url` and decode it. `/v1/pd/info` tells a router (or a peer) the
role, the model and the KV layout, `/v1/pd/load` what a router's PD policy sees of it; `/v1/pd/kv/offer` is
what a decode server calls on a prefill server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fastapi import Request

from ernie_jax.engine.kv_connector import KV_LOAD_FAILURE_POLICIES, KVExporter, KVImporter, KVLayout, KVTransferError
from ernie_jax.engine.step import Prefilled
from ernie_jax.sampling import SamplingParams
from ernie_jax.serve.protocol import ProtocolError

log = logging.getLogger("ernie_jax.serve")

PD_ROLES = ("mixed", "prefill", "decode")


@dataclasses.dataclass
class PDServer:
    role: str = "mixed"
    exporter: KVExporter | None = None
    importer: KVImporter | None = None
    kv_load_failure_policy: str = "recompute"
    api_key: str | None = None  # sent to prefill servers' offer route
    recomputed: int = 0  # remotely prefilled requests whose KV could not be pulled, prefilled here again
    reused_pages: int = 0  # prompt pages not pulled: this server's prefix cache held them
    # role switching: the builders of this server's exporter and importer (each made when first needed and
    # kept: its transfer server and its counters), and whether a switch is draining the server
    make_exporter: Any = None
    make_importer: Any = None
    switching: bool = False

    def __post_init__(self):
        if self.role not in PD_ROLES:
            raise ValueError(f"pd role {self.role!r}: expected one of {PD_ROLES}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy {self.kv_load_failure_policy!r}: expected one of "
                             f"{KV_LOAD_FAILURE_POLICIES}")

    def info(self, model_name: str) -> dict:
        """The role, model and KV layout (what a router or a peer checks), and the transfer counters."""
        kv = self.exporter or self.importer
        transfers: dict[str, Any] = {}
        if (e := self.exporter) is not None and self.role == "prefill":
            kept = e.sweep()  # expired ones counted first
            transfers = {"exported": e.exported, "offered": e.offered, "offered_sharded": e.sharded,
                         "expired": e.expired, "kept": kept, "skipped_pages": e.skipped_pages, "bytes": e.bytes,
                         "seconds": round(e.seconds, 6)}
        elif (i := self.importer) is not None and self.role == "decode":
            transfers = {"pulled": i.pulled, "pulled_sharded": i.sharded, "failed": i.failed,
                         "recomputed": self.recomputed, "reused_pages": self.reused_pages, "bytes": i.bytes,
                         "seconds": round(i.seconds, 6)}
        return {"role": self.role, "model": model_name, "kv_layout": kv.layout.to_json() if kv is not None else None,
                "transfer_address": self.exporter.address if self.exporter is not None else None,
                "transfers": transfers}

    def offer(self, request_id: Any, skip: Any = 0, shards: Any = "") -> dict:
        if self.exporter is None:
            raise ProtocolError("this server exports no KV (it was not started with --pd-role prefill)", status=400)
        if not isinstance(request_id, str):
            raise ProtocolError("request_id must be a string", param="request_id")
        if not isinstance(skip, int) or skip < 0:
            raise ProtocolError("skip_pages must be a non-negative integer", param="skip_pages")
        if not isinstance(shards, str):
            raise ProtocolError("shards must be a string (the puller's KV pool layout)", param="shards")
        try:
            return self.exporter.offer(request_id, skip, shards)
        except KeyError:
            raise ProtocolError(f"no KV kept for request {request_id!r} (unknown, already pulled, or expired "
                                f"after {self.exporter.expiry:.0f} s)", status=404, param="request_id") from None

    async def prepare(self, kv: dict | None, prompts: list[list[int]], params: SamplingParams, engine) -> dict:
        """The engine.add_request keyword arguments a request's kv_transfer_params ask for ({} for none);
        for a remotely prefilled request this pulls its KV first. ProtocolError for parameters this server
        cannot take, naming the field."""
        if not kv:
            return {}
        if self.switching:
            raise ProtocolError(f"this server is switching its role from {self.role}; retry elsewhere", status=503)
        if len(prompts) != 1 or params.n != 1:
            raise ProtocolError("kv_transfer_params need one prompt and n = 1", param="kv_transfer_params")
        if params.prompt_logprobs is not None:
            raise ProtocolError("prompt logprobs are not served across a prefill/decode split",
                                param="kv_transfer_params")
        if kv.get("do_remote_decode"):
            if self.role != "prefill":
                raise ProtocolError("do_remote_decode: this server exports no KV (start it with --pd-role "
                                    "prefill)", param="kv_transfer_params")
            return {"export_kv": True}
        if not kv.get("do_remote_prefill"):
            raise ProtocolError("kv_transfer_params need do_remote_decode or do_remote_prefill",
                                param="kv_transfer_params")
        if self.role != "decode":
            raise ProtocolError("do_remote_prefill: this server imports no KV (start it with --pd-role decode)",
                                param="kv_transfer_params")
        return {"prefilled": await self._pull(kv, prompts[0], params, engine)}

    async def switch(self, role: Any, engine, timeout: float) -> dict:
        """Change this server's role once it is drained: no request queued or running and no kept KV (offered
        or expired); 409 when that takes longer than `timeout` seconds (the role stays). Weights, programs and
        the KV pool stay; new PD requests get a 503 while it drains (a router stops sending them first)."""
        if role not in PD_ROLES:
            raise ProtocolError(f"role {role!r}: expected one of {PD_ROLES}", param="role")
        if self.switching:
            raise ProtocolError("a role switch is already under way", status=409)
        self.switching, t0 = True, time.monotonic()
        try:
            while True:
                stats = engine.stats()
                busy = stats.num_running + stats.num_waiting + (self.exporter.sweep() if self.exporter else 0)
                if not busy:
                    break
                if time.monotonic() - t0 > timeout:
                    raise ProtocolError(f"not drained within {timeout:.0f} s ({stats.num_running} running, "
                                        f"{stats.num_waiting} waiting, KV kept for pulls); still {self.role}",
                                        status=409)
                await asyncio.sleep(0.05)
            if role == "prefill" and self.exporter is None:
                self.exporter = await asyncio.to_thread(self.make_exporter)
            if role == "decode" and self.importer is None:
                self.importer = await asyncio.to_thread(self.make_importer)
            old, self.role = self.role, role
            log.info("pd role %s -> %s after draining %.2f s", old, role, time.monotonic() - t0)
            return {"role": role, "previous": old, "drained_seconds": round(time.monotonic() - t0, 3)}
        finally:
            self.switching = False

    async def _pull(self, kv: dict, prompt: list[int], params: SamplingParams, engine) -> Prefilled:
        try:
            layout = KVLayout.from_json(kv["kv_layout"])
            rid, url = str(kv["remote_request_id"]), str(kv["remote_url"])
            first, n_prompt, num_pages = int(kv["first_token_id"]), int(kv["num_prompt_tokens"]), \
                int(kv["remote_num_pages"])
            drafts = [int(t) for t in kv["drafts"]] if isinstance(kv.get("drafts"), list) else None
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"kv_transfer_params: missing or malformed field {e}", param="kv_transfer_params") \
                from None
        if why := self.importer.layout.mismatch(layout):
            raise ProtocolError(f"kv_transfer_params: the prefill server's KV cannot enter this server's pool: "
                                f"{why}", param="kv_transfer_params")
        if n_prompt != len(prompt):
            raise ProtocolError(f"kv_transfer_params: the prefill server computed {n_prompt} prompt tokens, this "
                                f"request has {len(prompt)}", param="kv_transfer_params")
        vocab_size = engine.info().vocab_size
        if not 0 <= first < vocab_size:
            raise ProtocolError(f"kv_transfer_params: first_token_id {first} is outside [0, {vocab_size})",
                                param="kv_transfer_params")
        lp = kv.get("first_token_logprob")
        batch, reused = None, 0
        if params.max_tokens != 1:  # otherwise the first token is the whole answer
            # the leading pages this server's prefix cache holds are not sent (one page at least is)
            reused = min(engine.cached_prefix_pages(prompt), num_pages - 1)
            batch = await self._fetch(url, rid, reused)
        if batch is None:
            reused = 0
        self.reused_pages += reused
        return Prefilled(first, lp if isinstance(lp, dict) else None, drafts, batch, num_pages - reused, reused)

    async def _fetch(self, url: str, rid: str, skip: int):
        """The request's page batch from the prefill server at url: an offer, then a pull (tried twice); on
        failure None (recompute) or a 502 (kv_load_failure_policy "fail")."""
        import httpx  # here: only a decode server pulls, and a mixed server starts 0.2 s sooner without it

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        why = ""
        try:
            body = {"request_id": rid, "skip_pages": skip, "shards": self.importer.layout.shards}
            async with httpx.AsyncClient(timeout=30) as client:
                r = await client.post(url.rstrip("/") + "/v1/pd/kv/offer", json=body, headers=headers)
            if r.status_code != 200:
                why = f"the offer was refused ({r.status_code}: {r.text[:200]})"
            else:
                offer = r.json()
                for attempt in range(2):
                    try:
                        return await asyncio.to_thread(self.importer.pull, offer)
                    except KVTransferError as e:
                        why = str(e)
                        log.warning("KV pull for %s from %s failed (attempt %d): %s", rid, url, attempt + 1, e)
        except httpx.HTTPError as e:
            why = f"{url} did not answer: {e!r}"
        if self.kv_load_failure_policy == "fail":
            raise ProtocolError(f"the KV of {rid} could not be loaded from {url}: {why}", status=502,
                                param="kv_transfer_params")
        self.recomputed += 1
        log.warning("the KV of %s could not be loaded from %s (%s): recomputing its prompt here", rid, url, why)
        return None


def add_pd_routes(app, server) -> None:
    """/v1/pd/info, /v1/pd/load, /v1/pd/kv/offer and /pd_role_switch on a server's app (serve/api.Server)."""

    @app.get("/v1/pd/info")
    async def pd_info() -> dict:
        """This server's role, model and KV layout, its transfer counters, and the most samples (n) it takes
        in one request (a router sends no more apart)."""
        return {**server.pd.info(server.model_name), "max_n": server.max_n}

    @app.get("/v1/pd/load")
    async def pd_load() -> dict:
        """What a router's PD policy sees of this server: its instance (engine/policy.InstanceView, as the
        last published stats have it) and the prompts waiting."""
        stats = server.engine.stats()
        return {"view": dataclasses.asdict(list(stats.views.values())[-1]), "waiting": stats.num_waiting}

    @app.post("/pd_role_switch")
    async def pd_role_switch(request: Request) -> dict:
        """Drain this server and change its role (SGLang's route): {"role": ..., "timeout": seconds}."""
        if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise ProtocolError("missing or wrong API key (Authorization: Bearer <key>)", status=401)
        try:
            body = await request.json()
            role, timeout = body.get("role"), float(body.get("timeout", 60))
        except (ValueError, AttributeError, TypeError):
            raise ProtocolError('the body must be a JSON object {"role": ..., "timeout": seconds}') from None
        return await server.pd.switch(role, server.engine, timeout)

    @app.post("/v1/pd/kv/offer")
    async def pd_offer(request: Request) -> dict:
        """A decode server asks for a request's KV: it is handed to the transfer server for one pull."""
        try:
            body = await request.json()
        except ValueError:
            raise ProtocolError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ProtocolError("the request body must be a JSON object")
        return await asyncio.to_thread(server.pd.offer, body.get("request_id"), body.get("skip_pages", 0),
                                       body.get("shards", ""))
