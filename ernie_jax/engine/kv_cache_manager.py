"""The KV cache manager: which pages of one instance's pool each request holds, and the prefix cache over them.

It sits between the scheduler (engine/scheduler.py), which decides who runs, and the page pool
(engine/pages.py), which counts references. It owns:
- the prefix lookup: the leading full pages of a request's sequence the pool already caches, unless an
  earlier request is computing the next one (then the request waits and takes it from the cache once
  written, so `n` samples of one prompt, or a burst sharing a system prompt, compute the shared part once);
- allocation: a prompt's pages at admission (minus the cached ones), then, per decode step, the pages the
  step writes, including `lookahead` slots past the last token (speculative decoding's drafts);
- registration: a request's full pages enter the prefix cache as soon as the program writing them is
  dispatched (later programs on the pool run after it);
- freeing, and the prefix statistics (tokens looked up, tokens the cache served).

Plain Python, no JAX: the scheduler's tests and the simulator use it as the engine does.
"""

from __future__ import annotations

from ernie_jax.engine.pages import PagePool, page_hashes
from ernie_jax.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: PagePool, *, max_pages: int, lookahead: int = 0):
        """max_pages: the most pages one sequence holds (max_model_len's); lookahead: tokens past the last
        one whose KV a decode step writes and keeps (the k speculative drafts)."""
        self.pool, self.max_pages, self.lookahead = pool, max_pages, lookahead
        self._computing: dict[bytes, Request] = {}  # page hash -> the request computing that page
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which the cache held

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def check_fits(self, tokens: int) -> str | None:
        """Why a request that may grow to `tokens` can never be served by this pool, or None."""
        pool = self.pool
        if pool.pages_for(tokens) > pool.capacity:
            return (f"it may need {pool.pages_for(tokens)} pages of {pool.page_size} tokens ({tokens} tokens), "
                    f"more than the whole KV pool holds ({pool.capacity} pages)")
        return None

    # ---- prefix lookup and admission ------------------------------------------------------------------------
    def computed_pages(self, req: Request) -> list[int] | None:
        """The cached leading pages of req's sequence (prompt and any output kept over a preemption), or None
        when an earlier request is computing its next page (take it from the cache once written). At least
        one token is always left to compute: its logits give the next token. Prompt-scoring requests get no
        cached pages (they need every position's logits)."""
        tokens = req.num_tokens
        hashes = self._hashes(req, tokens)
        cached = [] if req.scores_prompt else self.pool.lookup(hashes[:(tokens - 1) // self.page_size])
        if len(cached) < len(hashes) and self._computing.get(hashes[len(cached)], req) is not req:
            return None
        return cached

    def new_pages_for(self, req: Request, cached: list[int]) -> tuple[int, int]:
        """(pages to allocate beyond `cached`, how many of `cached` count among the pool's free pages)."""
        held_free = sum(1 for p in cached if self.pool.refs(p) == 0)
        return self.pool.pages_for(req.num_tokens) - len(cached), held_free

    def allocate_prompt(self, req: Request, cached: list[int]) -> None:
        """Give req its sequence's pages: the cached ones (a reference each) and new ones for the rest; the
        pages it will compute are marked as being computed by it."""
        pool = self.pool
        need, _ = self.new_pages_for(req, cached)
        pool.acquire(cached)
        req.pages = cached + pool.allocate(need)
        req.num_registered = len(cached)
        for h in self._hashes(req, req.num_tokens)[len(cached):]:
            self._computing.setdefault(h, req)
        if not req.scores_prompt and pool.enable_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(cached) * pool.page_size

    def allocate_handed_over(self, req: Request, reused: int = 0) -> list[int] | None:
        """Pages for a request whose KV arrives from elsewhere (the caller checked room): its first `reused`
        from the prefix cache (the sender did not send them), fresh ones for the rest; returns the fresh ones,
        or None (nothing allocated) when the cache no longer holds those `reused` pages."""
        cached = self.pool.lookup(self._hashes(req, len(req.prompt_ids))[:reused]) if reused else []
        if len(cached) < reused:
            return None
        self.pool.acquire(cached)
        fresh = self.pool.allocate(self.pool.pages_for(req.num_tokens) - len(cached))
        req.pages, req.num_registered = cached + fresh, len(cached)
        return fresh

    def cached_prompt_pages(self, prompt_ids: list[int]) -> int:
        """How many leading full pages of this prompt the prefix cache holds now."""
        pool = self.pool
        if not pool.enable_caching:
            return 0
        return len(pool.lookup(page_hashes(list(prompt_ids), pool.page_size, pool.salt, [])))

    # ---- growth ---------------------------------------------------------------------------------------------
    def slots_needed(self, req: Request, in_flight: int) -> int:
        """Pages req needs beyond those it holds for its next decode step: the KV of its newest token, the
        `in_flight` tokens a step still running adds before it, and the lookahead slots."""
        tokens = req.num_tokens + in_flight + self.lookahead
        return max(0, min(self.pool.pages_for(tokens), self.max_pages) - len(req.pages))

    def allocate_slots(self, req: Request, in_flight: int) -> None:
        if n := self.slots_needed(req, in_flight):
            req.pages += self.pool.allocate(n)

    # ---- the prefix cache -----------------------------------------------------------------------------------
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

    # ---- freeing --------------------------------------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Release req's pages (registered ones stay cached) and its claims on pages being computed."""
        if req.pages:
            self.pool.release(req.pages)
            req.pages = []
        req.num_registered = 0
        for h in [h for h, r in self._computing.items() if r is req]:
            del self._computing[h]

    def check(self) -> None:
        """The pool's invariant, and no claim on a page being computed by a request holding no pages."""
        self.pool.check()
        assert all(r.pages for r in self._computing.values()), "a page is being computed by a request without pages"
