"""How many KV pages an instance's pool gets: given (vLLM's num_gpu_blocks_override), a fraction of each
device's memory beside what is resident (gpu_memory_utilization) and what the instance's heaviest programs
allocate while they run (their temporaries: vLLM profiles a forward pass for the same reason), or, where
the devices report no memory limit (XLA:CPU), max_num_seqs x max_model_len tokens."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from ernie_jax.model.kv_cache import KVCache


def memory_stats(devices: list) -> list[dict] | None:
    """This process's devices' memory stats (an empty list where it holds none of them: a submesh of other
    processes), or None when the platform reports no memory limit (XLA:CPU: asked of a local device)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = [d.memory_stats() for d in local or jax.local_devices()[:1]]
    if any(s is None or "bytes_limit" not in s for s in stats):
        return None
    return stats if local else []


def pages_in_memory(devices: list, page_bytes: int, utilization: float, reserve: int = 0) -> int | None:
    """KV pages of page_bytes (per device) that fit in `utilization` of every device's memory beside what is
    resident already (the weights) and `reserve` bytes (the programs' temporaries); None when the platform
    reports no memory limit (XLA:CPU). Devices of other processes (a mesh across hosts) report through their
    own process: every process computes its local count, and all take the smallest, so each compiles the
    same pool."""
    stats = memory_stats(devices)
    if stats is None:
        return None
    room = min((utilization * s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats), default=np.inf)
    pages = max(0, int(min(room - reserve, 2**62) // page_bytes))  # no device here: the others decide
    if jax.process_count() > 1:  # every process builds every instance, so all take part
        from jax.experimental import multihost_utils
        pages = int(np.min(multihost_utils.process_allgather(np.int64(pages))))
    return pages


def size_pool(cfg, *, dtype, page_size: int, mtp: bool, shardings: Callable, devices: list, num_pages: int | None,
              memory_utilization: float | None, pages_without_memory_limit: int, name: str,
              temporaries: Callable[[int], int] = lambda pages: 0) -> tuple[int, str]:
    """(pages of the pool, the null page included; which rule sized it). shardings(cache): the pool's
    shardings (what one device holds of a page). temporaries(pages): the bytes per device the instance's
    heaviest program allocates beside its arguments, compiled against a pool of that many pages; asked only
    where the pool is sized from device memory (a compile: a GPU's first start pays it once, then the
    compilation cache holds it)."""
    if num_pages is not None:
        return num_pages, "--num-gpu-blocks-override"
    n = 64  # pages of a probe pool (a multiple of any data-axis split of the pages)
    probe = jax.eval_shape(lambda: KVCache.create(cfg, n, page_size, dtype, mtp))
    page_bytes = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                     for a, s in zip(jax.tree.leaves(probe), jax.tree.leaves(shardings(probe)))) / n
    if memory_stats(devices) is not None:
        reserve = temporaries(n)
        num_pages = pages_in_memory(devices, int(np.ceil(page_bytes)), memory_utilization or 0.9, reserve)
        return num_pages, (f"{memory_utilization or 0.9:.2f} of device memory, less {reserve / 2**30:.2f} GiB "
                           "a device for the heaviest program's temporaries")
    if memory_utilization is not None:
        raise ValueError(f"{name}: the {devices[0].platform} devices report no memory limit, so "
                         "gpu_memory_utilization cannot size the KV pool; give num_gpu_blocks_override")
    return pages_without_memory_limit, "max_num_seqs x max_model_len (the devices report no memory limit)"
