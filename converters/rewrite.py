"""A Paddle-layout checkpoint rewritten tensor by tensor: what quantize_fp8, quantize_int and dequantize share.

`rewrite` walks the source's safetensors files in order; for every stored tensor a `Rewriter` says which
tensors it becomes (names, safetensors dtypes, shapes; the header is written first) and then produces them,
one source tensor at a time, so host memory stays near the largest tensor. The shard structure (file names,
`mtp/` subfolder, index) and the side files (tokenizer, generation config) are kept; config.json is the
source's as `edit_config` changes it. The output folder appears only when complete (DST.partial, renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Protocol

import numpy as np

from converters.progress import Progress
from ernie_jax.checkpoint.plan import CheckpointPlan
from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter, read_header
from ernie_jax.config import ErnieConfig


class Rewriter(Protocol):
    def specs(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
        """The (name, safetensors dtype, shape) of each tensor stored tensor `name` becomes (may be none)."""

    def values(self, name: str, ckpt: SafetensorsCheckpoint) -> list[tuple[str, np.ndarray]]:
        """Those tensors' values, in the order of `specs`."""


def tensor_roles(plan: CheckpointPlan) -> dict[str, tuple[str, str]]:
    """Stored tensor name -> (storage class as CheckpointPlan.keys_of says it, weights-pytree leaf)."""
    return {key: (storage, task.leaf) for task in plan.tasks for key, _, storage, _ in plan.keys_of(task)}


def open_plan(src: str, tool: str) -> CheckpointPlan:
    """The validated plan of a Paddle-layout source (the converters write that layout and read it)."""
    plan = CheckpointPlan(src, ErnieConfig.from_pretrained(src))
    if plan.layout.name != "paddle":
        raise SystemExit(f"{src}: {tool} writes the Paddle release layout and reads it too; got the "
                         f"{plan.layout.name!r} layout")
    plan.validate()
    return plan


def with_quantization_config(quantization_config: dict | None) -> Callable[[dict], dict]:
    """An `edit_config` that sets config.json's quantization_config (None: removes it)."""
    def edit(config: dict) -> dict:
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        return config if quantization_config is None else {**config, "quantization_config": dict(quantization_config)}
    return edit


def rewrite(src: str, dst: str, plan: CheckpointPlan, rewriter: Rewriter, edit_config: Callable[[dict], dict],
            label: str, quiet: bool = False) -> None:
    ckpt: SafetensorsCheckpoint = plan.ckpt
    tmp = dst.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = sorted({info.file for info in ckpt.tensors.values()})
    progress = None if quiet else Progress(sum(os.path.getsize(f) for f in files), label)
    index_maps: dict[str, dict[str, str]] = {}
    for file in files:
        rel = os.path.relpath(file, src)
        os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
        infos = read_header(file)
        specs = [spec for name, info in infos.items() for spec in rewriter.specs(name, tuple(info.shape))]
        writer = SafetensorsWriter(os.path.join(tmp, rel), specs)
        for name, info in infos.items():
            for out_name, arr in rewriter.values(name, ckpt):
                writer.write(out_name, arr)
            if progress:
                progress.update(info.nbytes)
        writer.close()
        index_maps.setdefault(os.path.dirname(rel), {}).update({s[0]: os.path.basename(rel) for s in specs})
    if progress:
        progress.close()
    for folder, weight_map in index_maps.items():
        if os.path.isfile(os.path.join(src, folder, "model.safetensors.index.json")):
            total = sum(SafetensorsCheckpoint(os.path.join(tmp, folder, f)).tensors[k].nbytes
                        for k, f in weight_map.items())
            with open(os.path.join(tmp, folder, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
    _copy_side_files(src, tmp)
    with open(os.path.join(src, "config.json")) as f:
        config = edit_config(json.load(f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def _copy_side_files(src: str, dst: str) -> None:
    """generation config, tokenizer and other small non-weight files."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, os.path.join(dst, name))
