"""Moving requests' KV pages between two instances' pools (prefill/decode disaggregation in one engine), and
the page gather and scatter programs that moves between servers use too (engine/kv_connector.py).

Under an instance across processes (engine/multihost.py) the two pools may lie on different processes'
devices (a submesh per process): every process makes the same gather and scatter calls, and the copy onto
the destination mesh is JAX's cross-host transfer (`jax_cross_host_transfer_socket_address`, set by
serve/distributed.py), sent by the source's process and received by the destination's."""

from __future__ import annotations

import time

import jax
import numpy as np

from ernie_jax.engine.multihost import collective
from ernie_jax.engine.shapes import buckets


def page_gather(programs):
    """A jitted (pool, page ids [n]) -> page batch: the pages' KV, each pool leaf [L, P, ...] -> [L, n, ...],
    laid out like the pool on its mesh."""
    return jax.jit(lambda cache, ids: jax.tree.map(lambda a: a[:, ids], cache),
                   in_shardings=(programs.cache_shardings, programs.replicated),
                   out_shardings=programs.cache_shardings)


def page_ids(programs, pages: list[int], n: int):
    """pages padded with the null page 0 to n ids, on the programs' mesh (a page batch's index)."""
    return programs.put(np.asarray(pages + [0] * (n - len(pages)), np.int32))


def page_scatter(programs):
    """A jitted (pool, page batch, page ids [n]) -> pool with the batch written at those pages (the pool
    donated); the batch is laid out like the pool (page ids past the real pages name the null page 0)."""
    return jax.jit(lambda cache, pages, ids: jax.tree.map(lambda a, p: a.at[:, ids].set(p), cache, pages),
                   donate_argnums=(0,), in_shardings=(programs.cache_shardings, programs.cache_shardings,
                                                      programs.replicated),
                   out_shardings=programs.cache_shardings)


class PageTransfer:
    """Moves requests' KV pages from one instance's pool to another's in two halves, each run by the thread
    of the instance whose pool it touches: `gather` (sender: gather the pages on the source mesh, one
    device_put onto the destination mesh, wait for it) and `scatter` (receiver: write them into its pool,
    donated, not waited for). Page counts are bucketed to powers of two, so a few compiled shapes serve
    every prompt length; `seconds` totals the gathers and copies."""

    def __init__(self, src, dst):
        """src, dst: the two instances' ModelPrograms."""
        self.src, self.dst = src, dst
        self.name, self.leader = f"{src.name}->{dst.name}", None  # a leader: the calls replay on every process
        self.buckets = buckets(src.max_pages)
        self.page_shardings = dst.cache_shardings  # a page batch is laid out like the pool it goes to
        self._gather, self._scatter = page_gather(src), page_scatter(dst)
        self.seconds, self.bytes, self.pages = 0.0, 0, 0  # totals of every gather
        self.last: tuple[list[int], list[int]] | None = None  # (source, destination) pages of the last move

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @collective(pinned=True)  # the batch waits in the peer's inbox until its scatter
    def gather(self, src_pages: list[int]):
        """The pages' KV as a page batch on the destination mesh; returns once the copy has landed on this
        process's devices (at once on a process that holds none of them: the sender of a cross-host copy)."""
        n = self.bucket(len(src_pages))
        t0 = time.perf_counter()
        pages = self._gather(self.src.cache, page_ids(self.src, src_pages, n))
        moved = jax.block_until_ready(jax.device_put(pages, self.page_shardings))
        self.seconds += time.perf_counter() - t0
        self.bytes += sum(a.nbytes for a in jax.tree.leaves(pages)) * len(src_pages) // n
        self.pages += len(src_pages)
        return jax.tree.leaves(moved)  # a list, which the leader's calls can name leaf by leaf

    @collective
    def scatter(self, moved, src_pages: list[int], dst_pages: list[int]) -> None:
        """Write the page batch gathered from src_pages (gather's leaves) into the destination pool at
        dst_pages (as many; the batch's padding goes to the null page)."""
        n = moved[0].shape[1]
        moved = jax.tree.unflatten(jax.tree.structure(self.page_shardings), moved)
        ids = page_ids(self.dst, dst_pages, n)
        self.dst.cache = self._scatter(self.dst.cache, moved, ids)
        self.last = (list(src_pages), list(dst_pages))

