"""One engine instance: a (sub)mesh's programs, its KV pool and scheduler, and the loop step that drives them.

Colocated serving has one instance ("mixed"); prefill/decode disaggregation has two ("prefill" and
"decode", on disjoint submeshes, each with its own copy of the weights). Each instance steps on its own:
`step()` = `begin()` (the step boundary: requests handed over to it, hand-overs, pages, admission, then
dispatch of one prefill step and one decode step) and `end()` (read the results), never waiting on the
other instance. Under an AsyncEngine each instance has its own thread; `Engine.step()` steps them in turn
(both dispatched before either is read).

Hand-over (PD): the sending instance gathers the request's pages, copies them onto the receiving mesh and
waits for that copy (its own thread waits, nobody else's), frees its pages and queues the request with
its KV in the receiver's inbox; the receiver, at its next boundary, takes pages for it, scatters the KV
in (dispatched, not waited for) and adds it to its decode batch. Which instance admits which prompts and
when requests move is the policy's (engine/policy.py).

Within an instance: a prefill step runs the oldest prefilling request's next chunk, batched with the next
ones whose chunks fit the same length bucket, up to `prefill_chunk` tokens (vLLM's max_num_batched_tokens);
a decode step runs every running request. While the decode batch is unchanged (and no request uses
penalties, which count every token on the host), a decode step's sampled tokens feed the next decode step
on the device before the host reads them, so the host's bookkeeping overlaps the device's next step; a
request that stops meanwhile has that one extra step computed (inside its own pages) and discarded.
"""

from __future__ import annotations

import collections
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from ernie_jax.engine.pages import PagePool
from ernie_jax.engine.policy import InstanceView, PDPolicy
from ernie_jax.engine.programs import ModelPrograms, PageTransfer, plain_sampling
from ernie_jax.engine.request import Request
from ernie_jax.engine.scheduler import Scheduler


class Dispatched(NamedTuple):
    """A program step in flight: its sampled tokens (and logprobs) and expert counts are still on the device."""
    kind: str  # "prefill" or "decode"
    reqs: list  # the request of each row (None: a prefill row mid-prompt)
    result: Any  # sample()'s (tokens, logprobs, top ids, top logprobs), or None for a chunk mid-prompt
    t0: float  # dispatch time
    counts: Any  # tokens per expert per MoE layer
    drafts: Any = None  # speculative decoding: the MTP block's next drafts [B,k]
    inputs: Any = None  # speculative decoding: its (positions [B,k+1], sampling steps [B]) on the device


class StepRecord(NamedTuple):
    """What one instance step ran, for timelines and for fitting the simulator's CPU cost model."""
    t0: float  # step boundary began
    t1: float  # results read
    prefill_tokens: int  # real prompt tokens in its prefill program (0: none)
    prefill_shape: tuple[int, int]  # the program's (B, T)
    prefill_context: int  # sum over rows of the positions the chunk attends to (start + chunk length)
    decode_rows: int  # real rows in its decode program (0: none)
    decode_batch: int  # the program's B
    decode_context: int  # sum over rows of the sequence length
    transfer_seconds: float  # of t1 - t0, the time its boundary spent handing requests' KV over


class Handoff(NamedTuple):
    """A request moving to another instance, with its KV already on the receiving mesh."""
    req: Request
    pages: Any  # the KV of its pages (a page batch laid out like the receiver's pool)
    src_pages: list[int]  # where they were in the sender's pool


class Instance:
    def __init__(self, name: str, home: str, programs: ModelPrograms, host, *, policy: PDPolicy,
                 waiting: list[Request], enable_prefix_caching: bool, salt: bytes):
        """host: the Engine (shared queue and lock, request rules: stop conditions, finishing)."""
        self.name, self.home, self.programs, self.host, self.policy = name, home, programs, host, policy
        self.pool = PagePool(programs.num_pages, programs.page_size, enable_caching=enable_prefix_caching, salt=salt)
        self.k = programs.k  # speculative tokens per step (0: none)
        self.scheduler = Scheduler(self.pool, waiting, max_num_seqs=host.max_num_seqs, max_pages=host.max_pages,
                                   lookahead=self.k)
        self.peer: Instance | None = None
        self.transfer: PageTransfer | None = None  # to the peer, when this instance hands over
        self.inbox: list[Handoff] = []  # requests handed to this instance (under host.lock)
        self.acting = home  # the role it plays now (policy.acting_role)
        self.busy_seconds = {"prefill": 0.0, "decode": 0.0}  # per program: dispatch to result
        self.steps = {"prefill": 0, "decode": 0}  # steps completed
        self.timeline: collections.deque[StepRecord] = collections.deque(maxlen=100_000)
        self.expert_tokens = np.zeros(host.expert_shape, np.int64)
        # A decode step whose tokens are still on the device: the next step feeds them to the following
        # decode step before reading them, so the host's work overlaps the device's (see begin()).
        self._ahead: Dispatched | None = None
        self._transfer = 0.0  # seconds this step's boundary has spent handing KV over
        self._in_step: list[Request] = []  # the requests of the steps this step() dispatches or reads
        self.decode_step_seconds = 0.0  # moving average of the steps that decoded (the policy's TPOT view)

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    def view(self) -> InstanceView:
        s = self.scheduler
        return InstanceView(self.name, self.home, len(s.prefilling), len(s.running), len(self.inbox),
                            s.max_num_seqs, self.pool.free, self.pool.capacity, self.decode_step_seconds)

    def _oldest_wait(self) -> float:
        waiting = self.host.waiting
        return self.host.now() - waiting[0].metrics.arrival_time if waiting else 0.0

    def holds(self, req: Request) -> bool:
        return self.scheduler.holds(req) or any(h.req is req for h in self.inbox)

    def idle(self) -> bool:
        """Nothing to run and nothing it may take from the queue now."""
        if self.scheduler.seats_taken or self.inbox:
            return False
        peer = self.peer.view() if self.peer else None
        return self.policy.admit_seats(self.view(), len(self.host.waiting), peer, self._oldest_wait()) == 0

    # ---- the step boundary ------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One step of this instance; returns the requests that got a token (or finished) in it."""
        touched: list[Request] = []
        self.end(self.begin(touched), touched)
        return touched

    def begin(self, touched: list[Request]):
        """The step boundary, then this step's programs dispatched; returns what end() reads."""
        t0, self._transfer, self._in_step = self.host.now(), 0.0, []
        self.take_placement()
        self._drop_aborted(touched)
        self._take_inbox()
        self._hand_over(touched)
        self._make_room(touched)
        with self.host.lock:
            peer = self.peer.view() if self.peer else None
            seats = self.policy.admit_seats(self.view(), len(self.host.waiting), peer, self._oldest_wait())
            if seats:
                self.scheduler.admit(self.host.now(), seats)
        self._note_role()
        prefill = self._prefill_rows() if self.prefilling else None  # this step's chunks
        return t0, self._shape(prefill), self._dispatch(touched, prefill)

    def end(self, pending, touched: list[Request]) -> None:
        t0, shape, (steps, scored) = pending
        self._read(steps, touched, scored)
        if shape is not None:
            record = StepRecord(t0, self.host.now(), *shape, self._transfer)
            self.timeline.append(record)
            if record.decode_rows:
                seconds = record.t1 - record.t0
                self.decode_step_seconds = seconds if not self.decode_step_seconds else \
                    0.8 * self.decode_step_seconds + 0.2 * seconds

    def _shape(self, prefill) -> tuple | None:
        """What this step runs (StepRecord's fields prefill_tokens .. decode_context), or None when it runs
        nothing. prefill: _prefill_rows() or None."""
        if prefill is None and not self.running:
            return None
        tokens, shape, context = 0, (0, 0), 0
        if prefill is not None:
            rows, T, B = prefill
            tokens, shape = sum(len(c) for _, _, c in rows), (B, T)
            context = sum(start + len(c) for _, start, c in rows)
        rows = len(self.running)
        batch = self.programs.bucket("decode", rows) if rows else 0
        return tokens, shape, context, rows, batch, sum(r.num_tokens for r in self.running)

    def take_placement(self) -> None:
        """EPLB: move the experts into a re-placement the engine queued for this instance (between steps)."""
        balancer = self.host.balancer
        if balancer is not None and (placement := balancer.take_pending(self.name)) is not None:
            self.programs.place_experts(placement)

    def _drop_aborted(self, touched: list[Request]) -> None:
        with self.host.lock:
            for h in [h for h in self.inbox if h.req.abort_requested]:
                self.inbox.remove(h)
                self.host.finish(h.req, "abort", None, self)
                touched.append(h.req)
        for req in [r for q in self.scheduler.queues for r in q if r.abort_requested]:
            self.host.finish(req, "abort", None, self)
            touched.append(req)

    def _take_inbox(self) -> None:
        """Requests handed over to this instance join its batch once it has pages and a seat for them."""
        with self.host.lock:
            arrived = []
            while self.inbox and self._landed(self.inbox[0]) and \
                    (pages := self.scheduler.receive(self.inbox[0].req)) is not None:
                arrived.append((self.inbox.pop(0), pages))
        for h, pages in arrived:
            self._copy_in(h, pages)
            h.req.decoded_on = self.name

    def _landed(self, h: Handoff) -> bool:
        return True  # the sender waited for the copy before queueing it

    def _copy_out(self, src_pages: list[int]):
        t0 = time.perf_counter()
        moved = self.transfer.gather(src_pages)
        self._transfer += time.perf_counter() - t0
        return moved

    def _copy_in(self, h: Handoff, pages: list[int]) -> None:
        self.peer.transfer.scatter(h.pages, h.src_pages, pages[:len(h.src_pages)])

    def _hand_over(self, touched: list[Request]) -> None:
        """Send the decoding requests the policy moves to the peer (their tokens must be on the host)."""
        if self.peer is None or not self.running:
            return
        with self.host.lock:
            n = self.policy.handover_count(self.view(), len(self.host.waiting), self.peer.view())
        if n == 0:
            return
        if self._ahead is not None:
            self._read([self._ahead], touched)
            self._ahead = None
        for req in list(self.running[:n]):
            if req.finished:
                continue
            src = list(req.pages)
            pages = self._copy_out(src)  # waits for the copy onto the peer's mesh
            with self.host.lock:  # one step for an abort to see: held here, or in the peer's inbox
                self.scheduler.send(req)
                self.peer.inbox.append(Handoff(req, pages, src))
            self.host.wake()

    def _make_room(self, touched: list[Request]) -> None:
        """Pages for the running batch's next step, preempting if the pool is short."""
        lag = 0 if self._ahead is None else self.k + 1  # tokens in flight per running request (at most)
        if self.scheduler.shortfall(lag) > 0 and self._ahead is not None:
            # A preemption changes the batch: the step in flight's tokens are needed on the host first.
            self._read([self._ahead], touched)
            self._ahead, lag = None, 0
        with self.host.lock:
            self.scheduler.grow(lag)

    def _note_role(self) -> None:
        acting = self.policy.acting_role(self.view())
        if acting != self.acting:
            self.host.role_switch(self.name, self.acting, acting)
            self.acting = acting

    def recover(self) -> tuple[list[Request], bool]:
        """After a step raised: fail the requests it ran; returns them and whether the pool was kept.

        When the pool is intact (ModelPrograms.cache_intact: the failure was on the host, or a program refused
        its inputs before running), only the requests of the failed step fail, their pages freed as at any
        finish, and the pool keeps its prefix cache: every page registered so far was written by a program
        that completed. Otherwise (a program failed on the device: every program donates the pool, so it may
        be consumed or half written) the pool is rebuilt zeroed, its prefix cache forgotten, the step in
        flight dropped, and every request that held pages here fails. Waiting and inbox ones stay."""
        failed = [r for r in {id(r): r for r in self._in_step}.values() if self.scheduler.holds(r)]
        self._in_step = []
        if not (failed and self.programs.cache_intact()):
            failed = []
        for req in failed:
            self.host.finish(req, "abort", None, self)
        if failed:
            try:
                self.pool.check()
                return failed, True
            except AssertionError:  # the failure left the page bookkeeping inconsistent: start afresh
                pass
        self._ahead = None
        lost = [r for q in self.scheduler.queues for r in q]
        for req in lost:
            self.host.finish(req, "abort", None, self)
        self.programs.reset_cache()
        self.pool.reset_cache()
        return failed + lost, False

    # ---- dispatch -------------------------------------------------------------------------------------------
    def _next_chunk(self, req: Request) -> list[int]:
        return req.prefill_ids[req.num_prefilled:req.num_prefilled + self.host.prefill_chunk]

    def _prefill_rows(self) -> tuple[list[tuple[Request, int, list[int]]], int, int]:
        """This step's prefill chunks: the oldest prefilling request's next chunk, joined by the next
        requests' chunks when a batched program (B > 1) of some length T holds them, up to its B (so at most
        max_num_batched_tokens tokens). Returns ([(request, start, chunk)], T, B)."""
        first, programs = self.prefilling[0], self.programs
        T = programs.bucket("prefill", len(self._next_chunk(first)))
        rows = [(first, first.num_prefilled, self._next_chunk(first))]
        batched = [t for b, t in programs.ready["prefill"] if b > 1 and t >= T]
        if not first.scores_prompt and batched and len(self.prefilling) > 1:
            wide = min(batched)
            room = programs.prefill_batches(wide)[-1] - 1
            others = [(r, r.num_prefilled, self._next_chunk(r)) for r in self.prefilling[1:]
                      if not r.scores_prompt and len(self._next_chunk(r)) <= wide][:room]
            if others:
                T, rows = wide, rows + others
        return rows, T, next(b for b in programs.prefill_batches(T) if b >= len(rows))

    def _table(self, pages: list[int]) -> np.ndarray:
        return np.asarray(pages + [0] * (self.programs.max_pages - len(pages)), np.int32)

    def _dispatch(self, touched: list[Request], prefill) -> tuple[list[Dispatched], list]:
        pending, scored = [], []
        if prefill is not None:
            pending.append(self._dispatch_prefill(prefill, scored))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not self._continues(ahead):
            # The batch changed since the step in flight was dispatched: its tokens are needed on the host.
            self._read([ahead], touched)
            ahead = None
        if self.running:
            step = self._dispatch_verify(ahead) if self.k else self._dispatch_decode(ahead)
            if self._chains(step):
                self._ahead = step  # read by the next step, while the device runs the one after it
            else:
                pending.append(step)
        if ahead is not None:
            pending.insert(0, ahead)
        return pending, scored

    def _dispatch_prefill(self, prefill, scored: list) -> Dispatched:
        rows, T, B = prefill
        self._in_step += [r for r, _, _ in rows]
        ids, positions = np.zeros((B, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (B, 1))
        tables = np.zeros((B, self.programs.max_pages), np.int32)  # padding rows write the null page 0
        last = np.full(B, -1, np.int32)  # -1: a padding row, no real token
        for i, (req, start, chunk) in enumerate(rows):
            ids[i, :len(chunk)] = chunk
            positions[i] += start
            tables[i] = self._table(req.pages)
            last[i] = len(chunk) - 1
        t0 = time.perf_counter()
        req, start, chunk = rows[0]
        arrays, nlp = self.host.sampling_arrays([r for r, _, _ in rows], B)
        if req.scores_prompt:  # a scored chunk runs alone
            targets = req.prompt_ids[start + 1:start + 1 + len(chunk)]  # the token after each position
            padded = np.asarray([targets + [0] * (T - len(targets))], np.int32)
            logits, c, scores = self.programs.run_scored(ids, positions, last, tables, padded)
            scored.append((req, start, targets, scores))
            sampled = None
        elif self.k:  # the MTP block drafts after each chunk; it needs the token after the chunk
            following = np.full(B, -1, np.int32)  # -1: the chunk ends its prompt (the sampled token follows)
            for i, (req, start, chunk) in enumerate(rows):
                if start + len(chunk) < len(req.prefill_ids):
                    following[i] = req.prefill_ids[start + len(chunk)]
            logits, c, sampled, drafts = self.programs.run("prefill", ids, positions, last, tables, arrays, following)
        else:
            logits, c, sampled = self.programs.run("prefill", ids, positions, last, tables, arrays)
        done = []  # rows whose prompt is now complete get their next token
        for req, start, chunk in rows:
            self.scheduler.prefilled(req, len(chunk))
            done.append(req if req.num_prefilled == len(req.prefill_ids) else None)
        if not any(done):  # chunks mid-prompt: only their expert counts
            return Dispatched("prefill", [], None, t0, c)
        result = sampled if sampled is not None and plain_sampling(arrays, nlp) else \
            self.programs.sample(logits, arrays, nlp)
        return Dispatched("prefill", done, result, t0, c, drafts if self.k and sampled is not None else None)

    def _dispatch_decode(self, ahead: Dispatched | None) -> Dispatched:
        reqs = list(self.running)
        self._in_step += reqs
        B = self.programs.bucket("decode", len(reqs))
        pad = B - len(reqs)
        lag = 0 if ahead is None else 1  # tokens in flight per request, not yet in output_ids
        if ahead is None:
            ids = np.asarray([[r.output_ids[-1]] for r in reqs] + [[0]] * pad, np.int32)
        else:  # the step in flight's sampled tokens, still on the device
            ids = ahead.result[0].reshape(B, 1)
        positions = np.asarray([[r.num_tokens - 1 + lag] for r in reqs] + [[0]] * pad, np.int32)
        tables = np.stack([self._table(r.pages) for r in reqs] + [self._table([])] * pad)
        last = np.asarray([0] * len(reqs) + [-1] * pad, np.int32)  # -1: a padding row, no real token
        arrays, nlp = self.host.sampling_arrays(reqs, B)
        arrays["steps"][:len(reqs)] += lag
        t0 = time.perf_counter()
        logits, c, sampled = self.programs.run("decode", ids, positions, last, tables, arrays)
        result = sampled if plain_sampling(arrays, nlp) else self.programs.sample(logits, arrays, nlp)
        return Dispatched("decode", reqs, result, t0, c)

    def _chains(self, step: Dispatched) -> bool:
        """Whether the next decode step may take `step`'s tokens on the device, unread: not when a row's
        sampler needs every previous token on the host (penalties; with speculation, any row that does not
        `speculate`, whose token the host sampler draws)."""
        if self.k:
            return step.result[1] is None
        return not any(r.params.uses_penalties for r in step.reqs)

    def _dispatch_verify(self, ahead: Dispatched | None) -> Dispatched:
        """A speculative decode step: each running request's last token and its k drafts (engine/speculative.py).
        After a step still in flight (`ahead`, the same batch), its inputs are computed on the device from
        that step's tokens, accepted counts and drafts (programs.chain_verify)."""
        reqs, k = list(self.running), self.k
        self._in_step += reqs
        B = self.programs.bucket("decode", len(reqs))
        pad = B - len(reqs)
        arrays, nlp = self.host.sampling_arrays(reqs, B)
        if ahead is None:
            ids = np.zeros((B, k + 1), np.int32)
            positions = np.zeros((B, k + 1), np.int32)
            for i, r in enumerate(reqs):
                ids[i] = [r.output_ids[-1]] + (r.drafts or [0] * k)  # no drafts (a scored prefill): rejected
                positions[i] = r.num_tokens - 1 + np.arange(k + 1)
        else:
            ids, positions, arrays["steps"] = self.programs.chain_verify(ahead)
        positions, arrays["steps"] = self.programs.put((positions, arrays["steps"]))
        tables = np.stack([self._table(r.pages) for r in reqs] + [self._table([])] * pad)
        last = np.asarray([k] * len(reqs) + [-1] * pad, np.int32)  # -1: a padding row, no real token
        speculating = [r.speculates for r in reqs]
        max_accept = np.asarray([k if s else 0 for s in speculating] + [0] * pad, np.int32)
        t0 = time.perf_counter()
        logits, c, verified, drafts = self.programs.run("decode", ids, positions, last, tables, arrays, max_accept)
        # rows that take one plain token (not speculating) draw it, with its logprobs, from the host's sampler
        fallback = None if all(speculating) else self.programs.sample(logits, arrays, nlp)
        return Dispatched("verify", reqs, (verified, fallback, speculating), t0, c, drafts,
                          (positions, arrays["steps"]))

    def _continues(self, step: Dispatched) -> bool:
        """Whether the next decode step can take `step`'s sampled tokens as they are on the device: the same
        requests in the same order, at the same batch size, and not all of them ending by length with those
        tokens (a step chained after them would be wasted device time)."""
        reqs = step.reqs
        rows = (step.drafts if step.kind == "verify" else step.result[0]).shape[0]
        return (len(reqs) == len(self.running) and all(a is b for a, b in zip(reqs, self.running))
                and rows == self.programs.bucket("decode", len(reqs))
                and not all(self.host.done_by_length(r, len(r.output_ids) + 1) for r in reqs))

    # ---- results --------------------------------------------------------------------------------------------
    def _read(self, pending: list[Dispatched], touched: list[Request], scored: tuple = ()) -> None:
        """Wait for dispatched steps and append their tokens (in dispatch order)."""
        self._in_step += [r for r, _, _, _ in scored] + [r for step in pending for r in step.reqs if r is not None]
        for req, start, targets, scores in scored:
            self.host.add_prompt_logprobs(req, start, targets, jax.device_get(scores))
        for kind, reqs, result, t0, counts, drafts, _ in pending:  # every program is in flight before any is read
            counts = jax.device_get(counts)
            self.expert_tokens += counts
            self.host.observe_expert_load(counts)
            if kind == "verify":
                self._read_verified(reqs, result, drafts, t0, touched)
                continue
            if result is not None:
                tokens, lps, top_ids, top_lps = jax.device_get(result)
            self.busy_seconds[kind] += time.perf_counter() - t0
            self.steps[kind] += 1
            if result is None:  # a prefill chunk mid-prompt
                continue
            drafts = None if drafts is None else jax.device_get(drafts)
            for i, req in enumerate(reqs):
                if req is not None:  # None: a prefill row mid-prompt
                    if drafts is not None:
                        req.drafts = drafts[i].tolist()
                    self._deliver(kind, req, int(tokens[i]), lps[i], top_ids[i], top_lps[i], touched)

    def _read_verified(self, reqs, result, drafts, t0, touched: list[Request]) -> None:
        """A speculative decode step's tokens: each row's accepted drafts and the token after them, appended
        one by one (a stop inside the run ends the request there); its next drafts kept for the next step."""
        (tokens, accepted), fallback, speculating = result
        tokens, accepted, fallback, drafts = jax.device_get((tokens, accepted, fallback, drafts))
        self.busy_seconds["decode"] += time.perf_counter() - t0
        self.steps["decode"] += 1
        none = np.zeros(0)
        for i, req in enumerate(reqs):
            if req.finished or req not in self.running:  # aborted, preempted or handed over meanwhile
                continue
            req.drafts = drafts[i].tolist()
            if not speculating[i]:
                tok, lps, top_ids, top_lps = (a[i] for a in fallback)
                self._deliver("decode", req, int(tok), lps, top_ids, top_lps, touched)
                continue
            self.host.spec_stats.observe(int(accepted[i]))
            for token in tokens[i, :int(accepted[i]) + 1]:
                self._deliver("decode", req, int(token), 0.0, none, none, touched)
                if req.finished:
                    break

    def _deliver(self, kind: str, req: Request, token: int, logprob, top_ids, top_lps, touched: list) -> None:
        """A step's token for req, unless it was aborted, preempted or handed over meanwhile."""
        if req.finished or req not in (self.prefilling if kind == "prefill" else self.running):
            return
        if kind == "prefill":
            self.scheduler.prompt_done(req)
            req.prefilled_on = req.decoded_on = self.name
        self.host.append(req, token, logprob, top_ids, top_lps, self)
        if not touched or touched[-1] is not req:
            touched.append(req)
