"""The ernie_jax checkpoint format: an Orbax PyTree checkpoint of per-layer, per-expert tensors.

Folder: `config.json` (+ generation config, tokenizer files), `ernie_jax_checkpoint.json` (format marker,
written last) and `state/` (Orbax). The tree mirrors CheckpointPlan task paths, e.g.
`layers/17/experts_up_gate/5` with a BlockFP8 stored as {values, scales} and an IntWeight as {int_values,
scales, int_format} (int_format: bits, group, rows and the compute mode's index): one stored tensor per stored
source tensor, so a converter holds one tensor at a time (Orbax partial saves) and a sharded restore can
read only what each device owns.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ernie_jax.checkpoint.safetensors_io import CheckpointError
from ernie_jax.quant import INT_COMPUTE, BlockFP8, IntWeight

MARKER = "ernie_jax_checkpoint.json"
FORMAT = "ernie_jax-orbax"
VERSION = 1


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


class OrbaxWriter:
    """Adds tensors to `<folder>/state` (an Orbax partial-save session) in batches of about `batch_bytes`:
    each partial save costs time that grows with the leaves already saved, so saving tensor by tensor is
    quadratic, while a batch the size of the largest tensor keeps memory near that tensor."""

    def __init__(self, folder: str, batch_bytes: int):
        from orbax.checkpoint.experimental.v1 import partial
        self._partial = partial
        self.state = os.path.join(folder, "state")
        self.batch_bytes = batch_bytes
        self._batch: dict = {}
        self._bytes = 0

    def add(self, path: tuple, value: np.ndarray | BlockFP8 | IntWeight) -> None:
        node = self._batch
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        if isinstance(value, BlockFP8):
            value = value.relayout(False)  # saved in the checkpoint's [in, out] orientation
        if isinstance(value, BlockFP8):
            node[str(path[-1])] = {"values": value.values, "scales": value.scales}
        elif isinstance(value, IntWeight):
            fmt = np.array([value.bits, value.group, value.rows, INT_COMPUTE.index(value.compute)], np.int32)
            node[str(path[-1])] = {"int_values": value.values, "scales": value.scales, "int_format": fmt}
        else:
            node[str(path[-1])] = value
        self._bytes += value.nbytes
        if self._bytes >= self.batch_bytes:
            self.flush()

    def flush(self) -> None:
        if self._batch:
            self._partial.save(self.state, self._batch)
            self._batch, self._bytes = {}, 0

    def finalize(self) -> None:
        self.flush()
        self._partial.finalize(self.state)


def write_marker(folder: str, **info) -> None:
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, **info}, f, indent=2)


def read_flat(folder: str) -> dict[tuple, np.ndarray | BlockFP8 | IntWeight]:
    """All tensors keyed by task path (ints restored), BlockFP8 and IntWeight rebuilt."""
    with open(os.path.join(folder, MARKER)) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise CheckpointError(f"{folder}/{MARKER}: unsupported format {marker.get('format')!r} version "
                              f"{marker.get('version')!r} (expected {FORMAT!r} {VERSION})")
    import orbax.checkpoint.experimental.v1 as ocp
    state = os.path.join(folder, "state")
    if not os.path.isdir(state):
        raise CheckpointError(f"{folder}: no state/ folder; the conversion did not finish")
    tree = ocp.load(state)
    block = int(marker.get("fp8_block", 128))
    flat: dict[tuple, Any] = {}

    def walk(node, path):
        if isinstance(node, dict) and set(node) == {"values", "scales"}:
            flat[path] = BlockFP8(np.asarray(node["values"]), np.asarray(node["scales"]), block=block)
        elif isinstance(node, dict) and set(node) == {"int_values", "scales", "int_format"}:
            bits, group, rows, compute = (int(v) for v in np.asarray(node["int_format"]))
            flat[path] = IntWeight(np.asarray(node["int_values"]), np.asarray(node["scales"]), bits, group, rows,
                                   INT_COMPUTE[compute])
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (int(k) if k.isdigit() else k,))
        else:
            flat[path] = np.asarray(node)
    walk(tree, ())
    return flat
