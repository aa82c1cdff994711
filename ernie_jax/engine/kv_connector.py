"""KV pages between server processes (prefill/decode disaggregation across servers): a prompt's pages leave the
prefill server's pool and enter the decode server's through `jax.experimental.transfer`; control messages
go over the servers' HTTP routes (serve/pd.py).

The protocol (prefill server P, decode server D, the router R in front of both):
1. R sends P the request with `kv_transfer_params: {"do_remote_decode": true}` and max_tokens 1. P prefills it
   and samples its first token; at the end of that step P's instance gathers the prompt's pages into one page
   batch on its first device (`KVExporter.export`) and frees them in its pool at once (the batch is a copy;
   the prefix cache keeps what it had). P's answer carries `kv_transfer_params` (`KVExporter.describe`): the
   request id, the first token (and its logprob entry, and the MTP drafts when P speculates), the page count
   and P's `KVLayout`.
2. R sends D the original request with those parameters and P's URL. D refuses a layout it cannot take (400
   naming the field that differs), applies the first token (it may already end the request), then asks P to
   offer the batch less the leading pages D's prefix cache holds (`POST /v1/pd/kv/offer`): P hands it to its
   transfer server under a fresh transfer id and forgets it (the transfer server holds it until pulled). D pulls it (`KVImporter.pull`, bounded in time)
   onto its first device, queues the request as handed over, and its scheduler gives it pages and a seat at
   the next step boundary, where its runner scatters the batch in, resharded onto its own mesh.
3. Failures: a batch not offered within `expiry` seconds is dropped by P (counted); an offer for an unknown or
   expired request is a 404; a pull that fails or times out is tried once more, and then D either recomputes the prompt itself (`kv_load_failure_policy="recompute"`, the default, vLLM's name) or
   fails the request (`"fail"`).

Shard by shard where the two pools lie alike. A pull names shapes and shardings, and `jax.experimental.transfer`
needs them to match what was offered shard for shard. The exporter keeps a batch laid out like its pool (each
device keeps its own shard of the prompt's pages), and the importer sends its pool's shard layout with the
offer request (`KVLayout.shards`: per pool leaf, the mesh's axis sizes and the partition spec; empty where a
device holds a replica of another's shard, since a transfer sends every device's shard, replicas included).
Where the two are equal and not empty, the batch crosses as it lies, every device's shard to the device in
the same place of the other mesh, and is written into the pool with no reshard. Otherwise (a decode mesh of
another size, another rules table, replicated KV heads) the exporter first copies the batch onto its first
device and the importer pulls it onto its own first device and reshards it there (a device_put). The offer's
answer says which (`sharded`), and /v1/pd/info counts both. A server whose pool spans processes offers and
pulls on process 0's first device, and its gather and scatter are calls every process makes
(engine/spanning_pool.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import secrets
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding

from ernie_jax.engine.page_transfer import page_gather, page_ids, page_scatter
from ernie_jax.engine.shapes import buckets
from ernie_jax.engine.spanning_pool import SpanningPool, spans_processes

log = logging.getLogger("ernie_jax.engine")

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVTransferError(RuntimeError):
    """A KV transfer between servers failed; the message names the peer and what failed."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What two servers must agree on for one's pages to be written into the other's pool."""
    model: str  # a fingerprint of the model config
    block_size: int
    leaves: tuple[tuple[str, tuple[int, ...], str], ...]  # per pool leaf: (path, shape less the page axis, dtype)
    # how the pool lies on its devices: per leaf, the mesh's axis sizes and the partition spec ("" when
    # unknown). Not a mismatch when it differs: the batch then crosses on one device (module docstring).
    shards: str = ""

    @classmethod
    def of(cls, programs) -> "KVLayout":
        cfg = json.dumps(programs.cfg.to_dict(), sort_keys=True, default=str).encode()
        flat = jax.tree_util.tree_flatten_with_path(programs.cache)[0]
        leaves = tuple((jax.tree_util.keystr(path), (a.shape[0],) + tuple(a.shape[2:]), str(a.dtype))
                       for path, a in flat)
        # a pool across processes offers and pulls on process 0's first device (engine/spanning_pool.py)
        shards = "" if spans_processes(programs) else shard_layout(jax.tree.leaves(programs.cache_shardings))
        return cls(hashlib.sha256(cfg).hexdigest()[:16], programs.page_size, leaves, shards)

    @classmethod
    def from_json(cls, d: dict) -> "KVLayout":
        try:
            return cls(str(d["model"]), int(d["block_size"]),
                       tuple((str(p), tuple(int(x) for x in s), str(t)) for p, s, t in d["leaves"]),
                       str(d.get("shards", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params.kv_layout is malformed: {e!r}") from None

    def to_json(self) -> dict:
        return {"model": self.model, "block_size": self.block_size, "leaves": [list(x) for x in self.leaves],
                "shards": self.shards}

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why pages laid out as `other` cannot enter a pool laid out as self (None: they can)."""
        if other.model != self.model:
            return f"another model (config fingerprint {other.model}, this server's {self.model})"
        if other.block_size != self.block_size:
            return f"block size {other.block_size} (this server's: {self.block_size})"
        if [p for p, _, _ in other.leaves] != [p for p, _, _ in self.leaves]:
            return (f"KV cache segments {[p for p, _, _ in other.leaves]} (this server's: "
                    f"{[p for p, _, _ in self.leaves]}; e.g. one side keeps the MTP layer's KV, or FP8 KV scales)")
        for (path, shape, dtype), (_, my_shape, my_dtype) in zip(other.leaves, self.leaves):
            if dtype != my_dtype:
                return f"KV dtype {dtype} for {path} (this server's: {my_dtype})"
            if shape != my_shape:
                return f"KV shape {shape} per page for {path} (this server's: {my_shape})"
        return None


def shard_layout(shardings) -> str:
    """Where each shard of arrays with these shardings lies, as a string two processes can compare: equal
    strings mean shard i of one side's array is shard i of the other's (same mesh shape, same specs, devices
    in mesh order). "" where some device holds a replica of another's shard: a transfer sends every device's
    shard, replicas included, so such a pool's pages cross on one device instead."""
    out = []
    for s in shardings:
        if isinstance(s, NamedSharding):
            used = [ax for entry in s.spec if entry is not None
                    for ax in (entry if isinstance(entry, tuple) else (entry,))]
            if math.prod(s.mesh.shape[ax] for ax in used) != s.mesh.size:
                return ""
            out.append([[list(kv) for kv in s.mesh.shape.items()], str(s.spec)])
        elif isinstance(s, SingleDeviceSharding):
            out.append("one device")
        else:
            return ""  # nothing to compare: the batch crosses on one device
    return json.dumps(out)


def _start_server(device, address: str):
    """A transfer server on device's client at address ("HOST" or "HOST:PORT"; no port or 0: a free one)."""
    from jax.experimental import transfer
    host, _, port = (address or "127.0.0.1").partition(":")
    bind = f"{host}:{port or 0}"
    try:
        return transfer.start_transfer_server(device.client, bind, [f"{host}:0"])
    except Exception as e:  # noqa: BLE001 -- the runtime's error names the address
        raise KVTransferError(f"cannot start the KV transfer server at {bind}: {e}") from None


@dataclasses.dataclass
class _Export:
    batch: Any  # the page batch, laid out like the pool
    num_pages: int
    deadline: float
    continuation: dict  # what the decode side needs besides the KV (the first token, ...)


class KVExporter:
    """The prefill side: page batches of requests that finished their prefill for a remote decode, kept for
    `expiry` seconds until the decode side asks for them."""

    def __init__(self, programs, address: str = "", expiry: float = 120.0):
        self.programs, self.expiry = programs, expiry
        self.device = programs.devices[0]
        self.layout = KVLayout.of(programs)
        self.server = _start_server(self.device, address)
        self.address = self.server.address()
        self._gather = page_gather(programs)
        # a pool across processes: every process gathers (the leader's call is replayed), process 0 keeps its copy
        self.across: SpanningPool | None = programs.kv_across
        self._buckets = buckets(programs.max_pages)
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}
        self.exported = self.offered = self.expired = self.skipped_pages = self.sharded = 0
        self.bytes, self.seconds = 0, 0.0

    def export(self, req, pages: list[int]) -> None:
        """Gather the pages of req's prompt into a page batch laid out like the pool (the caller's thread steps
        the pool: nothing writes these pages before the gather has read them) and keep it for an offer, with
        what the decode side continues from: the first token (its logprob entry) and the MTP drafts."""
        t0 = time.perf_counter()
        n = next(b for b in self._buckets if b >= len(pages))
        if self.across is not None:
            batch = self.across.local_copy(self.across.gather(pages, n))
        else:
            batch = self._gather(self.programs.cache, page_ids(self.programs, pages, n))
        with self._lock:
            self._sweep()
            self._exports[req.request_id] = _Export(batch, len(pages), time.monotonic() + self.expiry, {
                "first_token_id": req.output_ids[0], "first_token_logprob": req.logprobs[0] if req.logprobs else None,
                "drafts": req.drafts, "num_prompt_tokens": len(req.prompt_ids)})
            self.exported += 1
        self.seconds += time.perf_counter() - t0

    def describe(self, request_id: str) -> dict | None:
        """The part of kv_transfer_params that says where the request's pages are (None: not exported)."""
        with self._lock:
            e = self._exports.get(request_id)
        if e is None:
            return None
        return {"do_remote_prefill": True, "remote_request_id": request_id, "remote_num_pages": e.num_pages,
                "kv_layout": self.layout.to_json(), **e.continuation}

    def offer(self, request_id: str, skip: int = 0, shards: str = "") -> dict:
        """Hand the request's batch, less its first `skip` pages (the puller's prefix cache holds them), to the
        transfer server under a fresh transfer id and forget it; returns what the puller needs. `shards`: the
        puller's pool layout (KVLayout.shards); where it is this pool's, the batch is offered as it lies,
        otherwise on the first device. KeyError when there is none (unknown, already offered, or expired)."""
        with self._lock:
            self._sweep()
            e = self._exports.pop(request_id)
            self.offered += 1
        skip = max(0, min(int(skip), e.num_pages - 1))
        n = e.num_pages - skip
        size = next(b for b in self._buckets if b >= n)  # a bucketed page count: few shapes to compile

        def cut(a):
            x = a[:, skip:skip + size]
            pad = size - x.shape[1]
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
        leaves = jax.tree.leaves(e.batch)
        if skip:  # put back onto the batch's sharding, so a shard-by-shard offer still matches the puller's
            leaves = [jax.device_put(cut(a), a.sharding) for a in leaves]
        sharded = bool(shards) and shards == self.layout.shards
        if not sharded:
            leaves = jax.device_put(leaves, SingleDeviceSharding(self.device))
        transfer_id = secrets.randbits(62)
        self.server.await_pull(transfer_id, leaves)
        self.bytes += sum(a.nbytes for a in leaves) * n // leaves[0].shape[1]
        self.skipped_pages += skip
        self.sharded += sharded
        return {"transfer_id": transfer_id, "transfer_address": self.address, "num_pages": n,
                "bucket": leaves[0].shape[1], "skipped_pages": skip, "sharded": sharded}

    def _sweep(self) -> None:
        now = time.monotonic()
        for rid in [r for r, e in self._exports.items() if e.deadline < now]:
            del self._exports[rid]
            self.expired += 1
            log.warning("KV of %s was not pulled within %.0f s: dropped", rid, self.expiry)

    def sweep(self) -> int:
        """Drop expired batches now; returns how many are kept."""
        with self._lock:
            self._sweep()
            return len(self._exports)


class KVImporter:
    """The decode side: pulls a page batch a prefill server offered and writes it into this pool."""

    def __init__(self, programs, address: str = "", timeout: float = 30.0):
        self.programs, self.timeout = programs, timeout
        self.device = programs.devices[0]
        self.layout = KVLayout.of(programs)
        self.server = _start_server(self.device, address)
        self._connections: dict[str, Any] = {}
        self._scatter = page_scatter(programs)
        self.across: SpanningPool | None = programs.kv_across  # a pool across processes
        self._lock = threading.Lock()
        self.pulled = self.failed = self.sharded = 0
        self.bytes, self.seconds = 0, 0.0

    def pull(self, offer: dict) -> Any:
        """The offered batch (offer: KVExporter.offer's answer) as a pytree like this pool's: laid out like the
        pool when it was offered shard by shard, else on this server's first device; raises KVTransferError
        naming the peer when it does not arrive in time."""
        address, bucket, sharded = offer["transfer_address"], int(offer["bucket"]), bool(offer.get("sharded"))
        t0 = time.perf_counter()
        flat, tree = jax.tree.flatten(self.programs.cache)
        shardings = (jax.tree.leaves(self.programs.cache_shardings) if sharded
                     else [SingleDeviceSharding(self.device)] * len(flat))
        specs = [jax.ShapeDtypeStruct((a.shape[0], bucket) + a.shape[2:], a.dtype, sharding=s)
                 for a, s in zip(flat, shardings)]
        result: dict[str, Any] = {}

        def run():
            try:
                with self._lock:
                    if address not in self._connections:
                        self._connections[address] = self.server.connect(address)
                    conn = self._connections[address]
                result["leaves"] = jax.block_until_ready(conn.pull(int(offer["transfer_id"]), specs))
            except Exception as e:  # noqa: BLE001 -- reported to the caller with the peer's address
                result["error"] = e
                with self._lock:
                    self._connections.pop(address, None)
        worker = threading.Thread(target=run, daemon=True, name="ernie-kv-pull")
        worker.start()
        worker.join(self.timeout)
        if "leaves" not in result:
            self.failed += 1
            why = f"{result['error']}" if "error" in result else f"no data within {self.timeout:.0f} s"
            raise KVTransferError(f"pulling KV from {address} failed: {why}")
        self.pulled += 1
        self.sharded += sharded
        self.seconds += time.perf_counter() - t0
        self.bytes += sum(a.nbytes for a in result["leaves"]) * int(offer["num_pages"]) // bucket
        return jax.tree.unflatten(tree, result["leaves"])

    def scatter(self, batch, pages: list[int]) -> None:
        """Write a pulled batch into this pool at `pages` (one per real page of the batch); on the thread that
        steps the pool."""
        if self.across is not None:
            self.across.place(batch, pages)
            return
        n = jax.tree.leaves(batch)[0].shape[1]
        ids = page_ids(self.programs, pages, n)
        batch = jax.device_put(batch, self.programs.cache_shardings)  # a no-op for a batch pulled shard by shard
        self.programs.cache = self._scatter(self.programs.cache, batch, ids)
