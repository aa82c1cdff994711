"""Device meshes: `make_mesh(spec, devices)` for a device count or named axis sizes, on any device subset.

Every mesh has the three axes ("data", "expert", "tensor"), in that order, so one rules table serves all
shapes. A plain count N means (data=1, expert=1, tensor=N): attention is split by heads over "tensor" and
the experts over "expert" x "tensor" (see rules.py), which is how the 300B model fits 8 GPUs (a model whose
heads do not split whole over N has its attention replicated instead: fused.fit_plan).
Meshes are of AxisType.Auto (docs/xla-notes.md N1): programs are sharded by their input/output shardings and by
`shard_map` in the MoE block, never by ambient mesh context.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert", "tensor")


class MeshError(ValueError):
    """A mesh request that the devices at hand cannot satisfy."""


def parse_mesh_spec(spec: int | str | dict[str, int]) -> dict[str, int]:
    """8 -> {data:1, expert:1, tensor:8}; "data=1,expert=4,tensor=2" -> that; missing axes are 1."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise MeshError(f"mesh size must be >= 1, got {n}")
        return {"data": 1, "expert": 1, "tensor": n}
    if isinstance(spec, dict):
        sizes = dict(spec)
    else:
        sizes = {}
        for part in str(spec).split(","):
            if "=" not in part:
                raise MeshError(f"mesh spec {spec!r}: expected a device count or 'axis=size,...' "
                                f"with axes {AXES}")
            name, _, value = part.partition("=")
            name = name.strip()
            if name in sizes:
                raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: size of {name!r} is not an integer") from None
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise MeshError(f"mesh spec {spec!r}: unknown axes {sorted(unknown)}; the axes are {AXES}")
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise MeshError(f"mesh spec {spec!r}: axis sizes must be >= 1, got {bad}")
    return {a: sizes.get(a, 1) for a in AXES}


def request_host_devices(spec: int | str | dict[str, int] | None, processes: int = 1) -> int:
    """Ask XLA for as many host (CPU) devices as the mesh `spec` needs and return that count, so a CPU-only
    machine gets fake devices to build the mesh on; a mesh over `processes` processes (jax.distributed) asks
    each for its share. Must run before JAX creates its backends (importing jax is fine); it changes only the
    CPU platform, so on a GPU machine the GPUs stay the default devices. A device count already in XLA_FLAGS
    wins."""
    n = math.prod(parse_mesh_spec(spec).values()) if spec else 1
    if n % processes:
        raise MeshError(f"a mesh of {n} devices does not split evenly over {processes} processes")
    flags = os.environ.get("XLA_FLAGS", "")
    if n // processes > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n // processes}".strip()
    return n


def make_mesh(spec: int | str | dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "expert", "tensor") mesh over `devices` (default: all of them, in order).

    Named axis sizes must multiply to the number of devices; a plain count N takes the first N of `devices`,
    so disjoint submeshes are make_mesh(4, devs[:4]) and make_mesh(4, devs[4:]).
    """
    sizes = parse_mesh_spec(spec)
    n = int(np.prod(list(sizes.values())))
    available = list(devices) if devices is not None else jax.devices()
    if n > len(available):
        raise MeshError(f"mesh {sizes} needs {n} devices but only {len(available)} are available "
                        f"({available[0].platform if available else 'none'})")
    counted = isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit())
    if not counted and n != len(available):
        raise MeshError(f"mesh axes {sizes} multiply to {n}, but there are {len(available)} devices; name axes "
                        "that use every device, or give a plain device count")
    grid = np.array(available[:n], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))
