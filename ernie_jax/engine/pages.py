"""The pages of one paged KV pool: free list, reference counts, and the automatic prefix cache.

Page 0 is the null page: it is never handed out, and every unused block-table entry and every padded
batch row points at it, so their writes land where nobody reads.

Pages are handed out on demand (the engine asks for a prompt's pages when its prefill is scheduled and
for one more each time a sequence crosses a page boundary) and reference counted, so requests can share
pages. With prefix caching, a full page whose KV has been written is registered under the hash of its
token ids chained to its parent page's hash (the chain starts from a salt that names whatever else
changes the KV: the KV dtype, the page size); a later request whose prompt starts with the same pages
reuses them. A page whose last reference goes stays cached (free, evictable); allocation takes
never-cached pages first, then evicts cached free pages least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def page_hashes(tokens: list[int], page_size: int, salt: bytes, known: list[bytes]) -> list[bytes]:
    """The hash chain of the full pages of `tokens`: known (the hashes of the first pages, computed before)
    extended to every full page. hash_i = H(hash_{i-1} (the salt for page 0), page i's token ids)."""
    out = list(known)
    for i in range(len(out), len(tokens) // page_size):
        parent = out[-1] if out else salt
        page = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        out.append(hashlib.blake2b(parent + page, digest_size=16).digest())
    return out


class PagePool:
    def __init__(self, num_pages: int, page_size: int, *, enable_caching: bool = False, salt: bytes = b""):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_caching, self.salt = enable_caching, salt
        self._free = list(range(num_pages - 1, 0, -1))  # never-cached free pages; pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, LRU first
        self._refs = [0] * num_pages
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.evictions = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def free(self) -> int:
        """Pages an allocation can take: never-cached ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_free(self) -> int:
        """Cached pages no request holds (counted in `free`: they are evicted when the pool needs them)."""
        return len(self._evictable)

    @property
    def cached(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of pages held by requests (cached-but-free pages count as free)."""
        return 1.0 - self.free / self.capacity

    def refs(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= self.free

    def allocate(self, n: int) -> list[int]:
        """n pages nobody holds, each with one reference; evicts cached pages (LRU) once the others ran out."""
        if n > self.free:
            raise MemoryError(f"{n} KV pages requested, {self.free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
                self.evictions += 1
            self._refs[page] = 1
            out.append(page)
        return out

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of a hash chain (no references taken)."""
        out = []
        if self.enable_caching:
            for h in hashes:
                page = self._by_hash.get(h)
                if page is None:
                    break
                out.append(page)
        return out

    def acquire(self, pages: list[int]) -> None:
        """Take a reference on cached pages (found by lookup) for one more request."""
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1

    def register(self, page: int, page_hash: bytes) -> None:
        """Cache a held page whose KV is written (dispatched: later programs on the pool run after it)."""
        if not self.enable_caching or page in self._hash_of or page_hash in self._by_hash:
            return  # already cached, or the same content is cached in another page
        assert self._refs[page] > 0, f"page {page} is registered without a holder"
        self._by_hash[page_hash] = page
        self._hash_of[page] = page_hash

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page. Pages are given in sequence order; the tail is released first, so a
        sequence's last pages (the least likely to be shared) are evicted before its first ones."""
        if any(p <= 0 or p >= self.num_pages or self._refs[p] <= 0 for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"invalid pages returned to the allocator: {pages}")
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def reset_cache(self) -> None:
        """Forget every cached page no request holds (vLLM's reset_prefix_cache)."""
        for page in list(self._evictable):
            del self._by_hash[self._hash_of.pop(page)]
            self._free.append(page)
        self._evictable.clear()

    def check(self) -> None:
        """Invariants (tests): every page is exactly one of held, cached-free or never-cached-free."""
        held = {p for p in range(1, self.num_pages) if self._refs[p] > 0}
        free, evictable = set(self._free), set(self._evictable)
        assert not (held & free) and not (held & evictable) and not (free & evictable)
        assert held | free | evictable == set(range(1, self.num_pages)), "pages leaked"
        assert set(self._hash_of) == set(self._by_hash.values()) and evictable <= set(self._hash_of)
