"""The serving engine: continuous batching over paged KV pools, with prefill/decode disaggregation.

`Engine.step()` asks the scheduler (engine/scheduler.py: pages on demand, preemption, the prefix cache) for
this step's work, then runs one prefill step (the oldest admitted request's next chunk, batched with the
next ones whose chunks fit the same length bucket, up to `prefill_chunk` tokens: vLLM's
max_num_batched_tokens) and one decode step for every running request; requests join and leave the decode
batch at every step. Disaggregated (`prefill_model` given): prefill runs on its own devices with its own
copy of the weights and its own pool (which holds the prefix cache), decode on the rest; when a prompt is
done and the decode pool has its pages, they move there in one batched transfer. Prefill and decode are
dispatched before either result is read, so on disjoint devices they overlap. Colocated: both programs
share one mesh and one pool.
While the decode batch is unchanged (and no request uses penalties, which count every token on the host), a
decode step's sampled tokens feed the next decode step on the device before the host reads them, so the
host's bookkeeping overlaps the device's next step; a request that stops meanwhile has that one extra step
computed (inside its own pages) and discarded.
A request stops on EOS (unless ignore_eos), a stop token or string, max_tokens or max_model_len; `abort`
frees its pages at once. Bad requests raise `RequestError` at `add_request` and leave the engine serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from ernie_jax.engine.pages import PagePool
from ernie_jax.engine.programs import (ModelPrograms, PageTransfer, buckets, decode_buckets, min_decode_rows,
                                       plain_sampling, prefill_shapes)
from ernie_jax.engine.request import Request, RequestError, RequestMetrics
from ernie_jax.engine.scheduler import Scheduler
from ernie_jax.model.ernie import ErnieForCausalLM
from ernie_jax.ops.base import FALLBACKS
from ernie_jax.sampling import SamplingParams
from ernie_jax.tokenizer import IncrementalDetokenizer

__all__ = ["Engine", "Request", "RequestError", "CompileReport"]

log = logging.getLogger("ernie_jax.engine")


class Dispatched(NamedTuple):
    """A program step in flight: its sampled tokens (and logprobs) and expert counts are still on the device."""
    kind: str  # "prefill" or "decode"
    reqs: list  # the request of each row (None: a prefill row mid-prompt)
    result: Any  # sample()'s (tokens, logprobs, top ids, top logprobs), or None for a chunk mid-prompt
    t0: float  # dispatch time
    counts: Any  # tokens per expert per MoE layer


def _logprob_entry(token: int, logprob, top_ids, top_lps, n: int) -> dict[str, Any]:
    """One token's logprob with its top-n alternatives, as outputs carry them."""
    return {"token": int(token), "logprob": float(logprob),
            "top": list(zip(map(int, top_ids[:n]), map(float, top_lps[:n])))}


class CompileReport(NamedTuple):
    programs: list[tuple[str, Any, float]]  # (program, bucket, compile seconds)
    ops: list[dict[str, str]]  # {"op", "implementation", "passed_over", "layout_fallbacks"}


class Engine:
    def __init__(self, model: ErnieForCausalLM, *, prefill_model: ErnieForCausalLM | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, gpu_memory_utilization: float | None = None,
                 enable_prefix_caching: bool = True, prefill_chunk: int = 512, kv_cache_dtype: str = "auto",
                 eos_token_ids: frozenset[int] = frozenset(), tokenizer=None, seed: int = 0,
                 batch_invariant: bool = False, background_compile: bool = False):
        """model: the decode-side model (placed on its mesh). prefill_model: the same weights on a disjoint
        mesh for disaggregated prefill, or None to prefill with `model` (colocated).
        num_pages: pages per pool (vLLM's num_gpu_blocks_override), else sized from device memory
        (gpu_memory_utilization, default 0.9) or, where the devices report no memory limit (CPU),
        max_num_seqs x max_model_len tokens.
        batch_invariant: decode every batch at one shape (max_num_seqs rows) and prefill one prompt at a
        time, so a request's tokens do not depend on what else is running. Matmul kernels pick their
        reduction order by shape, so with several batch shapes a near-tie in greedy decoding can resolve
        differently alone and in a batch.
        background_compile: return once the largest bucket of each program compiled; the others compile
        in the background (a server is up sooner; small batches run padded until their bucket is ready)."""
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.cfg = model.config
        self.max_num_seqs, self.max_model_len, self.page_size = max_num_seqs, max_model_len, page_size
        self.max_pages = -(-max_model_len // page_size)
        self.prefill_chunk = min(prefill_chunk, self.max_pages * page_size)
        self.eos_token_ids, self.tokenizer = frozenset(eos_token_ids), tokenizer
        t0 = time.perf_counter()
        chunks = buckets(self.prefill_chunk, 16)
        batches = decode_buckets(max_num_seqs, min_decode_rows(model), batch_invariant)
        prefills = prefill_shapes(chunks, prefill_chunk, 1 if batch_invariant else max_num_seqs)
        pool = dict(num_pages=num_pages, page_size=page_size, max_pages_per_seq=self.max_pages,
                    kv_cache_dtype=kv_cache_dtype, batch_invariant=batch_invariant,
                    memory_utilization=gpu_memory_utilization,
                    pages_without_memory_limit=max_num_seqs * self.max_pages + 1)
        # A server compiles the prompt-scoring prefill of each chunk length behind it too, so the first echo
        # + logprobs request does not compile on the engine thread while streams wait.
        scoring = tuple(chunks) if background_compile else ()
        self.decoder = ModelPrograms(model, prefill_buckets=[] if prefill_model is not None else prefills,
                                     decode_buckets=batches, name="decode" if prefill_model is not None else
                                     "colocated", score_buckets=() if prefill_model is not None else scoring,
                                     **pool)
        if prefill_model is not None:
            self.prefiller = ModelPrograms(prefill_model, prefill_buckets=prefills, decode_buckets=[],
                                           name="prefill", score_buckets=scoring, **pool)
            self.transfer = PageTransfer(self.prefiller, self.decoder)
        else:
            self.prefiller, self.transfer = self.decoder, None
        # The prefix cache's hash chain starts from what else decides a page's KV besides its tokens.
        salt = f"kv {self.prefiller.cache.k[0].dtype} page {page_size}".encode()
        self.allocator = PagePool(self.decoder.num_pages, page_size,
                                  enable_caching=enable_prefix_caching and not self.disaggregated, salt=salt)
        self.prefill_allocator = PagePool(self.prefiller.num_pages, page_size, enable_caching=enable_prefix_caching,
                                          salt=salt) if self.disaggregated else None
        self.scheduler = Scheduler(self.allocator, self.prefill_allocator, max_num_seqs=max_num_seqs,
                                   max_pages=self.max_pages)
        for name, p in (("KV", self.allocator), ("prefill KV", self.prefill_allocator)):
            if p is not None and p.capacity < self.max_pages:
                log.warning("the %s pool holds %d tokens, less than max_model_len %d: requests that may grow "
                            "past it are rejected", name, p.capacity * page_size, max_model_len)
        programs = [self.decoder] + ([self.prefiller] if self.disaggregated else [])
        if background_compile:  # one thread, so serving keeps a core
            threading.Thread(target=lambda: [p.compile_rest(workers=1) for p in programs], daemon=True,
                             name="ernie-compile").start()
        else:
            for p in programs:
                p.compile_rest()
        self.startup_seconds = time.perf_counter() - t0
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)
        self.busy_seconds = {"prefill": 0.0, "decode": 0.0}  # per program kind: dispatch to result
        # A decode step whose tokens are still on the device: the next step feeds them to the following
        # decode step before reading them, so the host's work overlaps the device's (see step()).
        self._ahead: Dispatched | None = None
        self.moe_layers = [i for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i)]
        self.expert_tokens = np.zeros((len(self.moe_layers), self.cfg.moe_num_experts), np.int64)

    # ---- requests -----------------------------------------------------------------------------------------
    @property
    def disaggregated(self) -> bool:
        return self.transfer is not None

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def pools(self) -> dict[str, PagePool]:
        """The KV page pools by role: {"colocated": pool} or {"prefill": pool, "decode": pool}."""
        if not self.disaggregated:
            return {"colocated": self.allocator}
        return {"prefill": self.prefill_allocator, "decode": self.allocator}

    @property
    def compile_report(self) -> "CompileReport":
        """The compiled programs (name, bucket, seconds) and, per op, the implementation the programs run and
        why preferred ones were not used (ops/execution.py; layout fallbacks met while tracing included)."""
        programs = self.decoder.report + (self.prefiller.report if self.disaggregated else [])
        ops = self.decoder.execution.report()
        for entry in ops:
            entry["layout_fallbacks"] = "; ".join(f"{impl} -> xla for {why}" for op, impl, why in FALLBACKS
                                                  if op == entry["op"])
        return CompileReport(programs, ops)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                               "(and at least one token must be generated)")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                               f"max_model_len {self.max_model_len}")
        longest = min(len(prompt_ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if why := self.scheduler.check_fits(longest):
            limit = f"max_tokens {params.max_tokens}" if params.max_tokens else f"max_model_len {self.max_model_len}"
            raise RequestError(f"{len(prompt_ids)} prompt tokens with {limit}: {why}; lower max_tokens or "
                               "give the server more KV pages (--num-gpu-blocks-override, --gpu-memory-utilization)")
        V = self.cfg.vocab_size
        bad = [t for t in list(params.logit_bias or ()) + params.stop_token_ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"logit_bias / stop_token_ids name token ids outside [0, {V}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        req = Request(request_id, prompt_ids, params, seed, RequestMetrics(time.perf_counter()))
        if self.tokenizer is not None:
            req.text, req.detokenizer = "", IncrementalDetokenizer(self.tokenizer)
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort", None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        if req.detokenizer is not None and not isinstance(stop_reason, str):
            req.text = self.tokenizer.decode(req.output_ids)  # includes any bytes the stream held back
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.metrics.finished_time = time.perf_counter()
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)

    def recover(self) -> list[Request]:
        """After a step raised: every program donates its pool, so a device-side failure can leave a pool
        consumed. Rebuild each pool (zeroed; its prefix cache forgotten), drop the step in flight, and
        abort the requests that held pages (their KV is gone; waiting ones stay queued); returns them."""
        self._ahead = None
        s = self.scheduler
        lost = s.prefilling + s.transferring + s.running
        for req in lost:
            self._finish(req, "abort", None)
        for programs in {id(p): p for p in (self.decoder, self.prefiller)}.values():
            programs.reset_cache()
        for pool in self.pools.values():
            pool.reset_cache()
        return lost

    # ---- scheduling ---------------------------------------------------------------------------------------
    def _next_chunk(self, req: Request) -> list[int]:
        return req.prefill_ids[req.num_prefilled:req.num_prefilled + self.prefill_chunk]

    def _prefill_rows(self) -> tuple[list[tuple[Request, int, list[int]]], int, int]:
        """This step's prefill chunks: the oldest prefilling request's next chunk, joined by the next
        requests' chunks when a batched program (B > 1) of some length T holds them, up to its B (so at most
        max_num_batched_tokens tokens). Returns ([(request, start, chunk)], T, B)."""
        first = self.prefilling[0]
        T = self.prefiller.bucket("prefill", len(self._next_chunk(first)))
        rows = [(first, first.num_prefilled, self._next_chunk(first))]
        batched = [t for b, t in self.prefiller.ready["prefill"] if b > 1 and t >= T]
        if not first.scores_prompt and batched and len(self.prefilling) > 1:
            wide = min(batched)
            room = self.prefiller.prefill_batches(wide)[-1] - 1
            others = [(r, r.num_prefilled, self._next_chunk(r)) for r in self.prefilling[1:]
                      if not r.scores_prompt and len(self._next_chunk(r)) <= wide][:room]
            if others:
                T, rows = wide, rows + others
        return rows, T, next(b for b in self.prefiller.prefill_batches(T) if b >= len(rows))

    def _table(self, pages: list[int]) -> np.ndarray:
        return np.asarray(pages + [0] * (self.max_pages - len(pages)), np.int32)

    def _sampling_arrays(self, reqs: list[Request], B: int) -> tuple[dict, int]:
        """Per-row sampling inputs for the next token of each request (its index: len(output_ids), plus the
        tokens in flight the caller adds to `steps`)."""
        pad = B - len(reqs)
        steps = [len(r.output_ids) for r in reqs]
        f = lambda xs, fill=0.0: np.asarray(list(xs) + [fill] * pad, np.float32)  # noqa: E731
        p = [r.params for r in reqs]
        arrays = {"temperature": f(x.temperature for x in p), "top_p": f((x.top_p for x in p), 1.0),
                  "top_k": np.asarray([x.top_k for x in p] + [0] * pad, np.int32),
                  "seeds": np.asarray([r.seed for r in reqs] + [0] * pad, np.uint32),
                  "steps": np.asarray(steps + [0] * pad, np.int32),
                  "min_p": f(x.min_p for x in p) if any(x.min_p for x in p) else None, "penalties": None}
        suppress = [step < r.params.min_tokens for r, step in zip(reqs, steps)]  # step: the token's index
        if any(x.uses_penalties for x in p) or any(suppress):
            V = self.cfg.vocab_size
            counts, prompt_mask = np.zeros((B, V), np.float32), np.zeros((B, V), bool)
            bias = np.zeros((B, V), np.float32)
            for i, r in enumerate(reqs):
                np.add.at(counts[i], r.output_ids, 1)
                prompt_mask[i, r.prompt_ids] = True
                if r.params.logit_bias:
                    bias[i, list(r.params.logit_bias)] += list(r.params.logit_bias.values())
                if suppress[i]:  # min_tokens: no stop token before then
                    bias[i, list(self._stop_ids(r))] = -np.inf
            arrays["penalties"] = (f(x.presence_penalty for x in p), f(x.frequency_penalty for x in p),
                                   f((x.repetition_penalty for x in p), 1.0), counts, prompt_mask, bias)
        return arrays, max((x.logprobs or 0) for x in p)

    def _stop_ids(self, req: Request) -> set[int]:
        return set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else set(self.eos_token_ids))

    def _append(self, req: Request, token: int, logprob: float, top_ids, top_lps) -> None:
        now = time.perf_counter()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_ids.append(token)
        if req.params.logprobs is not None:
            req.logprobs.append(_logprob_entry(token, logprob, top_ids, top_lps, req.params.logprobs))
        if req.detokenizer is not None:
            req.text += req.detokenizer.add(token)
        n_out = len(req.output_ids)
        if token in self._stop_ids(req) and n_out >= req.params.min_tokens:
            return self._finish(req, "stop", token)
        if req.params.stop and n_out >= req.params.min_tokens:
            for s in req.params.stop:
                at = req.text.find(s)
                if at >= 0:
                    req.text = req.text[:at]
                    return self._finish(req, "stop", s)
        if self._done_by_length(req, n_out):
            return self._finish(req, "length", None)
        if req in self.running:
            self.scheduler.written(req, req.num_tokens - 1)  # every token but the newest has been fed

    def _make_room(self, touched: list[Request]) -> None:
        """Pages for the running batch's next step (preempting if the pool is short), then, disaggregated,
        move finished prompts whose decode pages are free into the decode pool."""
        lag = 0 if self._ahead is None else 1  # tokens in flight per running request
        if self.scheduler.shortfall(lag) > 0 and self._ahead is not None:
            # A preemption changes the batch: the step in flight's tokens are needed on the host first.
            self._read([self._ahead], touched)
            self._ahead, lag = None, 0
        self.scheduler.grow(lag)
        if self.disaggregated:
            for req, src in self.scheduler.hand_over():
                self.transfer(src, req.pages[:len(src)])
                self.scheduler.release_prefill(req)

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that got a token (or finished) in it."""
        touched: list[Request] = []
        self._make_room(touched)
        self.scheduler.admit(time.perf_counter())
        pending, scored = [], []
        if self.prefilling:
            rows, T, B = self._prefill_rows()
            ids, positions = np.zeros((B, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (B, 1))
            tables = np.zeros((B, self.max_pages), np.int32)  # padding rows write the null page 0
            last = np.full(B, -1, np.int32)  # -1: a padding row, no real token
            for i, (req, start, chunk) in enumerate(rows):
                ids[i, :len(chunk)] = chunk
                positions[i] += start
                tables[i] = self._table(req.prefill_pages if self.disaggregated else req.pages)
                last[i] = len(chunk) - 1
            t0 = time.perf_counter()
            req, start, chunk = rows[0]
            arrays, nlp = self._sampling_arrays([r for r, _, _ in rows], B)
            if req.scores_prompt:  # a scored chunk runs alone
                targets = req.prompt_ids[start + 1:start + 1 + len(chunk)]  # the token after each position
                padded = np.asarray([targets + [0] * (T - len(targets))], np.int32)
                logits, c, scores = self.prefiller.run_scored(ids, positions, last, tables, padded)
                scored.append((req, start, targets, scores))
                sampled = None
            else:
                logits, c, sampled = self.prefiller.run("prefill", ids, positions, last, tables, arrays)
            done = []  # rows whose prompt is now complete get their next token
            for req, start, chunk in rows:
                self.scheduler.prefilled(req, len(chunk))
                done.append(req if req.num_prefilled == len(req.prefill_ids) else None)
            if any(done):
                result = sampled if sampled is not None and plain_sampling(arrays, nlp) else \
                    self.prefiller.sample(logits, arrays, nlp)
                pending.append(Dispatched("prefill", done, result, t0, c))
            else:
                pending.append(Dispatched("prefill", [], None, t0, c))  # a chunk mid-prompt: only its expert counts
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not self._continues(ahead):
            # The batch changed since the step in flight was dispatched: its tokens are needed on the host.
            self._read([ahead], touched)
            ahead = None
        if self.running:
            reqs = list(self.running)
            B = self.decoder.bucket("decode", len(reqs))
            pad = B - len(reqs)
            lag = 0 if ahead is None else 1  # tokens in flight per request, not yet in output_ids
            if ahead is None:
                ids = np.asarray([[r.output_ids[-1]] for r in reqs] + [[0]] * pad, np.int32)
            else:  # the step in flight's sampled tokens, still on the device
                ids = ahead.result[0].reshape(B, 1)
            positions = np.asarray([[r.num_tokens - 1 + lag] for r in reqs] + [[0]] * pad, np.int32)
            tables = np.stack([self._table(r.pages) for r in reqs] + [self._table([])] * pad)
            last = np.asarray([0] * len(reqs) + [-1] * pad, np.int32)  # -1: a padding row, no real token
            arrays, nlp = self._sampling_arrays(reqs, B)
            arrays["steps"][:len(reqs)] += lag
            t0 = time.perf_counter()
            logits, c, sampled = self.decoder.run("decode", ids, positions, last, tables, arrays)
            result = sampled if plain_sampling(arrays, nlp) else self.decoder.sample(logits, arrays, nlp)
            step = Dispatched("decode", reqs, result, t0, c)
            if any(r.params.uses_penalties for r in reqs):
                pending.append(step)  # penalties count every output token: the host needs this one first
            else:
                self._ahead = step  # read by the next step, while the device runs the one after it
        if ahead is not None:
            pending.insert(0, ahead)
        self._read(pending, touched, scored)
        return touched

    def _done_by_length(self, req: Request, n_out: int) -> bool:
        """Whether n_out output tokens end req by length (max_tokens or max_model_len)."""
        return (req.params.max_tokens is not None and n_out >= req.params.max_tokens) or \
            len(req.prompt_ids) + n_out >= self.max_model_len

    def _continues(self, step: Dispatched) -> bool:
        """Whether the next decode step can take `step`'s sampled tokens as they are on the device: the same
        requests in the same order, at the same batch size, and not all of them ending by length with those
        tokens (a step chained after them would be wasted device time)."""
        reqs = step.reqs
        return (len(reqs) == len(self.running) and all(a is b for a, b in zip(reqs, self.running))
                and step.result[0].shape[0] == self.decoder.bucket("decode", len(reqs))
                and not all(self._done_by_length(r, len(r.output_ids) + 1) for r in reqs))

    def _read(self, pending: list[Dispatched], touched: list[Request], scored: tuple = ()) -> None:
        """Wait for dispatched steps and append their tokens (in dispatch order)."""
        for c in jax.device_get([step.counts for step in pending]):
            self.expert_tokens += c
        for req, start, targets, scores in scored:
            self._add_prompt_logprobs(req, start, targets, jax.device_get(scores))
        for kind, reqs, result, t0, _ in pending:  # every program is in flight before any is read
            if result is None:  # a prefill chunk mid-prompt
                continue
            tokens, lps, top_ids, top_lps = jax.device_get(result)
            self.busy_seconds[kind] += time.perf_counter() - t0
            for i, req in enumerate(reqs):
                # a prefill row mid-prompt, or a request aborted or preempted meanwhile
                if req is None or req.finished or (kind == "decode" and req not in self.running):
                    continue
                if kind == "prefill":
                    self.scheduler.prompt_done(req)
                self._append(req, int(tokens[i]), lps[i], top_ids[i], top_lps[i])
                touched.append(req)

    def _add_prompt_logprobs(self, req: Request, start: int, targets: list[int], scores) -> None:
        target_lp, top_ids, top_lps = (a[0] for a in scores)
        if start == 0:
            req.prompt_logprobs.append(None)  # nothing precedes the first prompt token
        for i, token in enumerate(targets):
            req.prompt_logprobs.append(_logprob_entry(token, target_lp[i], top_ids[i], top_lps[i],
                                                      req.params.prompt_logprobs))

    def run_until_done(self, request_ids: list[str]) -> None:
        targets = [self.requests[r] for r in request_ids]
        while not all(r.finished for r in targets):
            self.step()
