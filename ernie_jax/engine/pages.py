"""The page allocator of a paged KV pool: which pages are free, with admission control.

Page 0 is the null page: it is never handed out, and every unused block-table entry and every padded
batch row points at it, so their writes land where nobody reads. A request gets all the pages it can ever
need (prompt + max_tokens, capped at max_model_len) when it is admitted; when they are not free it waits,
so running requests can never run out of pages or corrupt each other's.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low page ids first

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.free / self.capacity

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV pages requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        if any(p <= 0 or p >= self.num_pages for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"invalid pages returned to the allocator: {pages}")
        self._free.extend(reversed(pages))
