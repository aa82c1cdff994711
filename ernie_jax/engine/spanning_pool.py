"""A KV pool whose mesh spans processes (one instance across processes, engine/multihost.py) exchanging pages
with another server (engine/kv_connector.py).

A prefill or decode server may itself be an instance across processes. Its KV connector still runs on
process 0 only (the HTTP routes, the transfer server, the pulls), and a transfer server sends and receives
arrays of its own process; the pool's shards lie on every process. So the two device steps that touch the
pool are calls every process makes (the leader's are replayed, `@collective`):
- `gather`: an exported prompt's pages gathered with a whole copy on every device of the mesh (an all-gather
  across the processes inside the program), so that process 0 offers its first device's copy;
- `place`: a pulled batch, on process 0's first device, written into the pool. Each process builds one
  array over the whole mesh with a slot per device (the batch in process 0's first device's slot, zeros in
  the others) and one program takes slot 0 onto every device and scatters it into the pool: the batch
  reaches the other processes through the program's own collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ernie_jax.engine.multihost import collective
from ernie_jax.engine.page_transfer import page_ids


def spans_processes(programs) -> bool:
    return len({d.process_index for d in programs.devices}) > 1


class SpanningPool:
    def __init__(self, programs):
        """programs: the instance's ModelPrograms (its mesh across processes)."""
        self.programs, self.name, self.leader = programs, f"{programs.name} kv connector", None
        mesh, cache = programs.plan.mesh, programs.cache_shardings
        self.slots = NamedSharding(mesh, P(mesh.axis_names))  # a leading axis, one slot per device
        self._gather = jax.jit(lambda pool, ids: jax.tree.map(lambda a: a[:, ids], pool),
                               in_shardings=(cache, programs.replicated), out_shardings=programs.replicated)
        self._place = jax.jit(lambda pool, slots, ids: jax.tree.map(lambda a, s: a.at[:, ids].set(s[0]), pool, slots),
                              donate_argnums=(0,), in_shardings=(cache, jax.tree.map(lambda _: self.slots, cache),
                                                                 programs.replicated),
                              out_shardings=cache)
        self._pulled: list | None = None  # process 0: the batch place() writes

    @collective
    def gather(self, pages: list[int], n: int):
        """The pages (padded to n with the null page) as a page batch with a whole copy on every device."""
        return self._gather(self.programs.cache, page_ids(self.programs, pages, n))

    def local_copy(self, batch):
        """Process 0's first device's copy of a gathered batch (a pytree of single-device arrays)."""
        first = self.programs.devices[0]
        return jax.tree.map(lambda a: next(s.data for s in a.addressable_shards if s.device == first), batch)

    def place(self, batch, pages: list[int]) -> None:
        """Process 0: write a batch pulled onto its first device into the pool at `pages` (one per real page)."""
        self._pulled = jax.tree.leaves(batch)
        self._place_slots([(tuple(a.shape), a.dtype.name) for a in self._pulled], list(pages))

    @collective
    def _place_slots(self, shapes: list, pages: list[int]) -> None:
        mine, self._pulled = self._pulled, None  # None on every process but 0
        first = self.programs.devices[0]
        ndev = len(self.programs.devices)
        local = [d for d in self.programs.devices if d.process_index == jax.process_index()]
        leaves = []
        for i, (shape, dtype) in enumerate(shapes):
            parts = [mine[i][None] if mine is not None and d == first else
                     jax.device_put(np.zeros((1, *shape), jnp.dtype(dtype)), d) for d in local]
            leaves.append(jax.make_array_from_single_device_arrays((ndev, *shape), self.slots, parts))
        slots = jax.tree.unflatten(jax.tree.structure(self.programs.cache), leaves)
        ids = page_ids(self.programs, pages, shapes[0][0][1])
        self.programs.cache = self._place(self.programs.cache, slots, ids)
