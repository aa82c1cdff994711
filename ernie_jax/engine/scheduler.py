"""The scheduler of one instance: at each step boundary it decides what the next step runs (`schedule()` ->
`StepPlan`), and it applies what a step produced (`update(StepResult)`). Plain Python, no JAX; it never
calls the engine or a runner, so the engine's runner and the simulator's drive the same code.

Queues: `waiting` (shared by every instance of an engine: FIFO, preempted requests go back to its front),
`prefilling` (seat and prompt pages held here), `running` (decoding here), `incoming` (handed over from
the peer instance, waiting for pages and a seat). A request's state is `Request.status`.

A boundary, in the order the instance driver (engine/instance.py) calls it:
1. `drop_aborted()`: requests another thread asked to abort finish here, pages freed.
2. `receive(now)`: requests handed over whose KV has landed get pages and a seat (the runner copies their
   KV in).
3. `needs_host_tokens(peer, in_flight)`, when the runner has a decode step in flight (its batch and B):
   whether this boundary changes the decode batch (a hand-over, a preemption, a request leaving or
   ending): then the runner reads that step first and `update()` applies it.
4. `schedule(now, peer, arrived, in_flight)`: hand-overs (PD policy, engine/policy.py), pages for the running batch's next
   step (preempting the most recently admitted requests while the pool is short: their pages are freed,
   they go back to the front of the queue and later prefill prompt plus output again, vLLM's recompute),
   admission, the prefill chunks under the token budget, the decode batch.
5. `dispatched(plan)` once the runner dispatched the plan: the pages its prefill writes enter the prefix
   cache.

Admission rule (starvation): FIFO with bounded bypass. When the oldest waiting request does not fit, later
ones that fit are admitted past it (a long prompt does not block short ones), but only `max_bypass` times;
after that nothing is admitted past it until it fits, which it does once running requests finish (every
request fits the pool alone: the engine checks that at add_request). vLLM's plain FIFO blocks everything
behind the head; skipping without the bound could starve a long prompt under a steady stream of short ones.
Admission leaves `watermark` of the pool free for running requests' growth.

Prefill chunks: the oldest prefilling request's next chunk (at most the token budget, vLLM's
max_num_batched_tokens), joined by the next requests' chunks when a batched program of some chunk length
holds them. A decode step runs every running request; while the batch is unchanged (and no row's sampler
needs its previous tokens on the host), its sampled tokens feed the next decode step on the device before
they are read (`StepPlan.chain`), so the host's work overlaps the device's. While nothing else waits, one
program may run several decode steps (`StepPlan.decode_steps`, multi-step decode), so the host's work per
step is spread over several tokens.
"""

from __future__ import annotations

from ernie_jax.engine.kv_cache_manager import KVCacheManager
from ernie_jax.engine.output_processor import OutputProcessor
from ernie_jax.engine.policy import InstanceView, PDPolicy
from ernie_jax.engine.request import Request, RequestStatus
from ernie_jax.engine.shapes import ShapeTable
from ernie_jax.engine.speculative import SpecDecodeStats
from ernie_jax.engine.step import Handoff, PrefillChunk, StepPlan, StepResult

WAITING, PREFILLING, RUNNING, HANDING_OVER, FINISHED = RequestStatus


class Scheduler:
    def __init__(self, name: str, home: str, kv: KVCacheManager, waiting: list[Request], *, policy: PDPolicy,
                 shapes: ShapeTable, outputs: OutputProcessor, max_num_seqs: int, max_num_batched_tokens: int,
                 spec_stats: SpecDecodeStats | None = None, max_bypass: int = 16, watermark: float = 0.01,
                 overlap: bool = True):
        """name, home: the instance and its home role ("prefill", "decode", "mixed"). waiting: the queue every
        instance of the engine admits from (its users hold the engine's lock while they change it).
        shapes: the compiled program shapes. outputs: the token and stop rules. overlap: whether decode
        steps may chain (a runner that cannot, like the simulator's, reads every step at its end)."""
        self.name, self.home, self.kv, self.waiting, self.policy = name, home, kv, waiting, policy
        self.shapes, self.outputs, self.spec_stats, self.overlap = shapes, outputs, spec_stats, overlap
        self.max_num_seqs, self.max_num_batched_tokens, self.max_bypass = max_num_seqs, max_num_batched_tokens, max_bypass
        self.reserve = max(1, int(watermark * kv.pool.capacity))
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.incoming: list[Handoff] = []
        self.outgoing: list[Request] = []  # handed over, their KV being copied to the peer
        # prefilled for another server's decode: the prompt's pages (freed here) that the runner exports before
        # the next step's programs are dispatched (engine/kv_connector.py)
        self.exports: list[tuple[Request, list[int]]] = []
        self.acting = home  # the role it plays now (policy.acting_role)
        self.decode_step_seconds = 0.0  # moving average of the steps that decoded (the policy's TPOT view)
        self._admissions = 0
        self.num_preemptions = 0
        self.prefill_tokens = 0  # tokens prefills computed (not served by the cache)

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def pool(self):
        return self.kv.pool

    @property
    def prefix_queries(self) -> int:
        return self.kv.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.kv.prefix_hits

    @property
    def seats_taken(self) -> int:
        return len(self.prefilling) + len(self.running)

    def _lag(self, in_flight) -> int:
        """Tokens per running request that a decode step still in flight adds (at most)."""
        return 0 if in_flight is None else self.kv.lookahead + 1

    def holds(self, req: Request) -> bool:
        """Whether req's seat, pages or hand-over is this instance's."""
        return req.holder == self.name and req.status in (PREFILLING, RUNNING, HANDING_OVER)

    def view(self) -> InstanceView:
        ready = self.shapes.ready
        return InstanceView(self.name, self.home, len(self.prefilling), len(self.running), len(self.incoming),
                            self.max_num_seqs, self.pool.free, self.pool.capacity, self.decode_step_seconds,
                            can_prefill=bool(ready["prefill"]), can_decode=bool(ready["decode"]))

    def observe_step(self, seconds: float) -> None:
        """A step that decoded took this long (the policy's TPOT view)."""
        self.decode_step_seconds = seconds if not self.decode_step_seconds else \
            0.8 * self.decode_step_seconds + 0.2 * seconds

    def _oldest_wait(self, now: float) -> float:
        return now - self.waiting[0].metrics.arrival_time if self.waiting else 0.0

    def idle(self, peer: InstanceView | None, now: float) -> bool:
        """Nothing to run and nothing it may take from the queue now."""
        if self.seats_taken or self.incoming:
            return False
        return self.policy.admit_seats(self.view(), len(self.waiting), peer, self._oldest_wait(now)) == 0

    def has_work(self) -> bool:
        return bool(self.seats_taken or self.incoming or self.outgoing)

    def take_exports(self) -> list[tuple[Request, list[int]]]:
        out, self.exports = self.exports, []
        return out

    def sent(self, req: Request) -> None:
        """req's KV reached the peer, which holds it now."""
        self.outgoing.remove(req)

    # ---- 1-3: the start of a boundary --------------------------------------------------------------------------
    def drop_aborted(self) -> list[Request]:
        """Finish the requests held here that another thread asked to abort; returns them."""
        out = [h.req for h in self.incoming if h.req.abort_requested]
        out += [r for q in (self.prefilling, self.running) for r in q if r.abort_requested]
        for req in out:
            self.abort(req)
        return out

    def abort(self, req: Request) -> None:
        """Finish req as aborted, freeing what it holds here."""
        self.incoming[:] = [h for h in self.incoming if h.req is not req]
        self.outputs.finish(req, "abort")
        self._release(req)

    def receive(self, now: float) -> list[tuple[Handoff, list[int]]]:
        """Requests handed over to this instance whose KV has landed, given pages and a seat while there is
        room (in arrival order); the runner copies their KV into the pages."""
        arrived = []
        while self.incoming and self.incoming[0].ready_at <= now:
            req = self.incoming[0].req
            need = self.pool.pages_for(req.num_tokens)
            if self.seats_taken >= self.max_num_seqs or need > self.pool.free - (self.reserve if self.running else 0):
                break
            h = self.incoming.pop(0)
            pages = self.kv.allocate_handed_over(req, h.reused)
            if pages is None:  # the pages it was to reuse left the prefix cache: its prompt is recomputed here
                req.status, req.holder = WAITING, None
                self.waiting.insert(0, req)
                continue
            req.admitted, self._admissions = self._admissions, self._admissions + 1
            req.status, req.holder, req.decoded_on = RUNNING, self.name, self.name
            self.running.append(req)
            arrived.append((h, pages))
        return arrived

    def needs_host_tokens(self, peer: InstanceView | None, in_flight: tuple[list[Request], int]) -> bool:
        """Whether the decode step in flight (its batch and program B, as the runner holds it) must be read
        before planning: the batch changes (a hand-over, a preemption for pages, a request that left or
        ended), its program size changed, or every row ends by length with the tokens in flight (chaining
        another step would be wasted)."""
        batch, B = in_flight
        return (self._hand_over_count(peer) > 0 or self._shortfall(self._lag(in_flight)) > 0
                or len(batch) != len(self.running) or any(a is not b for a, b in zip(batch, self.running))
                or B != self.shapes.bucket("decode", len(batch))
                or all(self.outputs.done_by_length(r, len(r.output_ids) + 1) for r in batch))

    # ---- 4: the plan --------------------------------------------------------------------------------------------
    def schedule(self, now: float, peer: InstanceView | None, arrived=(), in_flight=None) -> StepPlan:
        """Decide this step. arrived: what receive() returned at this boundary, carried in the plan for the
        runner. in_flight: the (batch, B) of a decode step the runner still has in flight, after
        needs_host_tokens said it may stay so (then nothing leaves the batch and the decode step follows it)."""
        hand_over = self._hand_over(peer) if in_flight is None else []
        preempted = self._grow(self._lag(in_flight))
        seats = self.policy.admit_seats(self.view(), len(self.waiting), peer, self._oldest_wait(now))
        admitted = self._admit(now, seats) if seats else []
        acting = self.policy.acting_role(self.view())
        role_switch = (self.acting, acting) if acting != self.acting else None
        self.acting = acting
        prefill, shape = self._prefill_chunks() if self.prefilling else ([], (0, 0))
        decode = list(self.running)
        B = self.shapes.bucket("decode", len(decode)) if decode else 0
        steps = self._decode_steps(B, self._lag(in_flight)) if decode and not prefill else 1
        plain = all(r.speculates for r in decode) if self.kv.lookahead else \
            not any(r.sampling_needs_history for r in decode)
        chain = self.overlap and bool(decode) and steps == 1 and plain
        return StepPlan(list(arrived), hand_over, preempted, admitted, prefill, shape, decode, B,
                        in_flight is not None, chain, role_switch, steps)

    def _decode_steps(self, B: int, lag: int) -> int:
        """How many decode steps the running batch's program runs (multi-step decode): n where a program of n
        steps is compiled for B, nothing waits for this instance (no queued, prefilling or arriving request:
        a new one waits at most one such program), every row samples on the device alone
        (`Request.speculates`) and takes all n tokens before max_tokens or max_model_len ends it (a stop token
        or string may still end it sooner: update() drops the tokens after it), and the pool holds their
        pages without preempting (they are allocated here); else 1."""
        n = self.shapes.decode_steps(B)
        if n == 1 or self.waiting or self.prefilling or self.incoming or self.kv.lookahead:
            return 1
        if not all(r.speculates and not self.outputs.done_by_length(r, len(r.output_ids) + lag + n - 1)
                   for r in self.running):
            return 1
        if self._shortfall(lag + n - 1) > 0:
            return 1
        for req in self.running:
            self.kv.allocate_slots(req, lag + n - 1)
        return n

    def _hand_over_count(self, peer: InstanceView | None) -> int:
        if peer is None or not self.running:
            return 0
        return self.policy.handover_count(self.view(), len(self.waiting), peer)

    def _hand_over(self, peer: InstanceView | None) -> list[tuple[Request, list[int]]]:
        """The decoding requests the policy moves to the peer, with their pages (freed here: the runner
        copies them out before anything else of this step runs)."""
        out = []
        for req in list(self.running[:self._hand_over_count(peer)]):
            pages = list(req.pages)
            self._release(req)
            req.status = HANDING_OVER  # still held by this instance until the peer's inbox has it
            self.outgoing.append(req)
            out.append((req, pages))
        return out

    def _shortfall(self, lag: int) -> int:
        """Pages the running batch lacks for its next step, beyond the free ones."""
        return sum(self.kv.slots_needed(r, lag) for r in self.running) - self.pool.free

    def _grow(self, lag: int) -> list[Request]:
        """Give every running request the pages its next step writes (lag: tokens a step in flight adds),
        preempting the most recently admitted requests of the pool until they fit; returns the preempted."""
        preempted = []
        while self._shortfall(lag) > 0:
            victim = max(self.running + self.prefilling, key=lambda r: r.admitted)
            self._preempt(victim)
            preempted.append(victim)
        for req in self.running:
            self.kv.allocate_slots(req, lag)
        return preempted

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_prefilled = 0
        if not req.output_ids:
            req.prompt_logprobs = []  # scored again from the start
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status, req.holder = WAITING, None
        self.waiting.insert(0, req)

    def _admit(self, now: float, max_seats: int) -> list[Request]:
        """Move waiting requests that get a seat (at most max_seats) and their pages to `prefilling`."""
        admitted, head = [], None  # head: the oldest request that did not fit
        pool = self.pool
        for req in list(self.waiting):
            if self.seats_taken >= self.max_num_seqs or (head is not None and head.bypassed >= self.max_bypass) \
                    or len(admitted) >= max_seats:
                break
            cached = self.kv.computed_pages(req)
            if cached is None:
                continue  # an earlier request is computing its next page: take it from the cache once written
            need, held_free = self.kv.new_pages_for(req, cached)
            if need > pool.free - held_free - (self.reserve if self.running else 0):
                head = head or req
                continue
            if head is not None:
                head.bypassed += 1
            self.waiting.remove(req)
            self.kv.allocate_prompt(req, cached)
            req.prefill_ids, req.num_prefilled = req.prompt_ids + req.output_ids, len(cached) * pool.page_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_prefilled
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.admitted, self._admissions, req.bypassed = self._admissions, self._admissions + 1, 0
            req.status, req.holder = PREFILLING, self.name
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def _next_chunk(self, req: Request) -> list[int]:
        return req.prefill_ids[req.num_prefilled:req.num_prefilled + self.max_num_batched_tokens]

    def _prefill_chunks(self) -> tuple[list[PrefillChunk], tuple[int, int]]:
        """This step's prefill chunks: the oldest prefilling request's next chunk, joined by the next
        requests' chunks when a batched program (B > 1) of some length T holds them, up to its B; and the
        program's (B, T). A prompt-scoring chunk runs alone."""
        first, shapes = self.prefilling[0], self.shapes
        T = shapes.bucket("prefill", len(self._next_chunk(first)))
        rows = [first]
        batched = shapes.batched_prefill_lengths(T)
        if not first.scores_prompt and batched and len(self.prefilling) > 1:
            wide = min(batched)
            room = shapes.prefill_batches(wide)[-1] - 1
            others = [r for r in self.prefilling[1:] if not r.scores_prompt and len(self._next_chunk(r)) <= wide]
            if others[:room]:
                T, rows = wide, rows + others[:room]
        chunks = []
        for req in rows:
            tokens, start = self._next_chunk(req), req.num_prefilled
            req.num_prefilled += len(tokens)
            self.prefill_tokens += len(tokens)
            chunks.append(PrefillChunk(req, start, tokens, req.num_prefilled == len(req.prefill_ids)))
        return chunks, (next(b for b in shapes.prefill_batches(T) if b >= len(rows)), T)

    # ---- 5 and results ------------------------------------------------------------------------------------
    def dispatched(self, plan: StepPlan) -> None:
        """The plan's programs are dispatched: the pages its prefill chunks write enter the prefix cache."""
        for chunk in plan.prefill:
            if self.holds(chunk.req):
                self.kv.written(chunk.req, chunk.start + len(chunk.tokens))

    def update(self, result: StepResult) -> list[Request]:
        """Apply a step's tokens (stop rules end requests and free their pages); returns the requests that
        got a token or finished, in order. Tokens for a request that meanwhile finished, was preempted or
        left this instance are dropped (that request's step was computed and is discarded)."""
        touched: list[Request] = []
        for req, start, targets, scores in result.scored:
            self.outputs.add_prompt_logprobs(req, start, targets, scores)
        for row in result.rows:
            req = row.req
            if req.holder != self.name or req.status is not (PREFILLING if row.kind == "prefill" else RUNNING):
                continue
            if row.drafts is not None:
                req.drafts = row.drafts
            if row.kind == "prefill":
                self.prefilling.remove(req)
                self.running.append(req)
                req.status, req.prefilled_on, req.decoded_on = RUNNING, self.name, self.name
            if row.accepted is not None and self.spec_stats is not None:
                self.spec_stats.observe(row.accepted)
            for i, token in enumerate(row.tokens):
                lp = row.logprobs if row.logprobs is not None else (0.0, (), ())
                if self.outputs.append(req, token, *lp):
                    if req.export_kv and row.kind == "prefill" and req.finish_reason == "length":
                        self.exports.append((req, req.pages[:self.pool.pages_for(len(req.prompt_ids))]))
                    self._release(req)
                    break
                self.kv.written(req, req.num_tokens - 1)  # every token but the newest has been fed
            if not touched or touched[-1] is not req:
                touched.append(req)
        return touched

    def _release(self, req: Request) -> None:
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        self.kv.free(req)
