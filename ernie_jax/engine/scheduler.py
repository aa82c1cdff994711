"""Who gets a batch seat and KV pages on one instance: admission, page growth, preemption, prefix caching.

Plain Python over the request queues and one instance's page pool (engine/pages.py); the instance asks it
at each step boundary and runs what it decided. Queues: `waiting` (shared by every instance of an engine:
FIFO, preempted requests go back to its front), `prefilling` (seat and prompt pages held here), `running`
(decoding here). Under PD a request moves between instances' schedulers with `send` / `receive`.

Pages on demand: a request gets its prompt's pages when it is admitted for prefill (minus the leading full
pages the prefix cache already holds) and one more page whenever its sequence crosses a page boundary.
When a running request needs a page and none is free, the most recently admitted request holding pages of
the pool is preempted: its pages are released (registered ones stay cached), it goes back to the front of
the queue and later prefills its prompt plus the tokens it already produced (recompute, vLLM's default).

Admission rule (starvation): FIFO with bounded bypass. When the oldest waiting request does not fit, later
ones that fit are admitted past it (a long prompt does not block short ones), but only `max_bypass` times;
after that nothing is admitted past it until it fits, which it does once running requests finish (every
request fits the pool alone: add_request checks it). vLLM's plain FIFO blocks everything behind the head;
skipping without the bound could starve a long prompt under a steady stream of short ones.

Prefix cache: a request's full pages are registered as soon as the program writing them is dispatched. A
request whose next uncached page is being computed by an earlier request waits for it instead of
computing it again (so `n` samples of one prompt, or a burst sharing a system prompt, prefill the shared
part once). At least one prompt token is always computed, since its logits give the first token.
Prompt-logprob requests bypass the lookup (they need every position's logits) but register their pages.
"""

from __future__ import annotations

from ernie_jax.engine.pages import PagePool, page_hashes
from ernie_jax.engine.request import Request


class Scheduler:
    def __init__(self, pool: PagePool, waiting: list[Request], *, max_num_seqs: int, max_pages: int,
                 max_bypass: int = 16, watermark: float = 0.01, lookahead: int = 0):
        """pool: this instance's pool; waiting: the queue every instance of the engine admits from.
        watermark: the fraction of the pool an admission leaves free for running requests' growth (vLLM's
        watermark), so a new prompt does not take the page a running stream needs next step.
        lookahead: tokens past its last one whose KV a decode step writes and may keep (speculative decoding:
        the k drafts)."""
        self.pool = pool
        self.max_num_seqs, self.max_pages, self.max_bypass = max_num_seqs, max_pages, max_bypass
        self.lookahead = lookahead
        self.reserve = max(1, int(watermark * pool.capacity))
        self.waiting = waiting
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self._computing: dict[bytes, Request] = {}  # page hash -> the prefilling request computing that page
        self._admissions = 0
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which the cache held
        self.prefill_tokens = 0  # tokens prefills computed (not served by the cache)

    @property
    def queues(self) -> tuple[list[Request], ...]:
        """The queues of requests this instance holds pages for."""
        return self.prefilling, self.running

    @property
    def seats_taken(self) -> int:
        return len(self.prefilling) + len(self.running)

    def holds(self, req: Request) -> bool:
        return any(req in q for q in self.queues)

    def check_fits(self, tokens: int) -> str | None:
        """Why a request that may grow to `tokens` can never be served by this pool, or None."""
        pool = self.pool
        if pool.pages_for(tokens) > pool.capacity:
            return (f"it may need {pool.pages_for(tokens)} pages of {pool.page_size} tokens ({tokens} tokens), "
                    f"more than the whole KV pool holds ({pool.capacity} pages)")
        return None

    # ---- admission ----------------------------------------------------------------------------------------
    def admit(self, now: float, max_seats: int | None = None) -> list[Request]:
        """Move waiting requests that get a seat (at most max_seats of them) and their prompt pages to
        `prefilling`; returns them. The caller holds the lock of the shared queue."""
        admitted, head = [], None  # head: the oldest request that did not fit
        pool = self.pool
        for req in list(self.waiting):
            if self.seats_taken >= self.max_num_seqs or (head is not None and head.bypassed >= self.max_bypass) \
                    or (max_seats is not None and len(admitted) >= max_seats):
                break
            ids = req.prompt_ids + req.output_ids
            hashes = self._hashes(req, len(ids))
            cached = [] if req.scores_prompt else pool.lookup(hashes[:(len(ids) - 1) // pool.page_size])
            if len(cached) < len(hashes) and self._computing.get(hashes[len(cached)], req) is not req:
                continue  # an earlier request is computing its next page: take it from the cache once written
            held_free = sum(1 for p in cached if pool.refs(p) == 0)  # cached pages counted as free
            need = pool.pages_for(len(ids)) - len(cached)
            reserve = self.reserve if self.running else 0
            if need > pool.free - held_free - reserve:
                head = head or req
                continue
            if head is not None:
                head.bypassed += 1
            self.waiting.remove(req)
            pool.acquire(cached)
            req.pages = cached + pool.allocate(need)
            req.prefill_ids, req.num_prefilled, req.num_registered = ids, len(cached) * pool.page_size, len(cached)
            for h in hashes[len(cached):]:
                self._computing.setdefault(h, req)
            if not req.scores_prompt and pool.enable_caching:
                self.prefix_queries += len(ids)
                self.prefix_hits += req.num_prefilled
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_prefilled
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.admitted, self._admissions, req.bypassed = self._admissions, self._admissions + 1, 0
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def _hashes(self, req: Request, tokens: int) -> list[bytes]:
        """The hash chain of the first tokens // page_size full pages of the request's sequence."""
        pool = self.pool
        full = tokens // pool.page_size
        if pool.enable_caching and len(req.page_hashes) < full:
            req.page_hashes = page_hashes(req.prompt_ids + req.output_ids, pool.page_size, pool.salt,
                                          req.page_hashes)
        return req.page_hashes[:full]

    def written(self, req: Request, tokens: int) -> None:
        """The KV of the request's first `tokens` tokens is written (dispatched): cache its full pages."""
        pool = self.pool
        if not pool.enable_caching or tokens // pool.page_size <= req.num_registered:
            return
        hashes = self._hashes(req, tokens)
        for i in range(req.num_registered, min(len(hashes), len(req.pages))):
            pool.register(req.pages[i], hashes[i])
            if self._computing.get(hashes[i]) is req:
                del self._computing[hashes[i]]
        req.num_registered = min(len(hashes), len(req.pages))

    def prefilled(self, req: Request, tokens: int) -> None:
        """A prefill chunk of `tokens` tokens was dispatched for req."""
        req.num_prefilled += tokens
        self.prefill_tokens += tokens
        self.written(req, req.num_prefilled)

    # ---- page growth and preemption -------------------------------------------------------------------------
    def _decode_need(self, req: Request, lag: int) -> int:
        """Pages req needs beyond those it holds to write its next token's KV (lag: tokens in flight)."""
        return max(0, min(self.pool.pages_for(req.num_tokens + lag + self.lookahead), self.max_pages) - len(req.pages))

    def shortfall(self, lag: int) -> int:
        """Pages the running batch lacks for its next step, beyond the free ones."""
        return sum(self._decode_need(r, lag) for r in self.running) - self.pool.free

    def grow(self, lag: int) -> list[Request]:
        """Give every running request the pages its next step writes, preempting the most recently admitted
        requests of the pool until they fit; returns the preempted requests. Call with lag 0 when any
        preemption may be needed (a preempted request's in-flight token must be on the host first); the
        caller holds the lock of the shared queue."""
        preempted = []
        while self.shortfall(lag) > 0:
            victim = max(self.running + self.prefilling, key=lambda r: r.admitted)
            self.preempt(victim)
            preempted.append(victim)
        for req in self.running:
            if n := self._decode_need(req, lag):
                req.pages += self.pool.allocate(n)
        return preempted

    def preempt(self, req: Request) -> None:
        self._release(req)
        req.num_prefilled = 0
        if not req.output_ids:
            req.prompt_logprobs = []  # scored again from the start
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def prompt_done(self, req: Request) -> None:
        self.prefilling.remove(req)
        self.running.append(req)

    # ---- moving between instances ---------------------------------------------------------------------------
    def send(self, req: Request) -> None:
        """req leaves this instance (its KV has been copied out): free its pages (registered ones stay
        cached here)."""
        self._release(req)

    def receive(self, req: Request) -> list[int] | None:
        """Pages and a seat for a request handed over from another instance, or None (nothing taken) when
        this instance has no room yet; the caller copies its KV into the pages."""
        need = self.pool.pages_for(req.num_tokens)
        if self.seats_taken >= self.max_num_seqs or need > self.pool.free - (self.reserve if self.running else 0):
            return None
        req.pages, req.num_registered = self.pool.allocate(need), 0
        req.admitted, self._admissions = self._admissions, self._admissions + 1
        self.running.append(req)
        return req.pages

    def finish(self, req: Request) -> None:
        self._release(req)

    def _release(self, req: Request) -> None:
        for queue in self.queues:
            if req in queue:
                queue.remove(req)
        if req.pages:
            self.pool.release(req.pages)
            req.pages = []
        req.num_registered = 0
        for h in [h for h, r in self._computing.items() if r is req]:
            del self._computing[h]
