"""`load_pretrained`: a checkpoint folder -> an `ErnieForCausalLM`, through the layout tables.

Every stored tensor is checked against the shape the config implies before it is used; missing,
unexpected, misshaped or wrongly typed tensors raise one `CheckpointError` naming the tensor, its file,
and the expected and found shapes. Nothing is guessed: an unknown layout is refused (layouts.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ernie_jax.checkpoint.layouts import DIM_MEANING, Cat, Layout, OneOf, Recipe, Src, detect_layout, dims
from ernie_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from ernie_jax.config import ErnieConfig
from ernie_jax.model.weights import F32_LEAVES, layer_shapes

FLOAT_STORAGE = {"F32", "BF16", "U16", "F16", "F64"}


class _Reader:
    """Evaluates recipes against one checkpoint and remembers which tensors were consumed."""

    def __init__(self, ckpt: SafetensorsCheckpoint, cfg: ErnieConfig):
        self.ckpt, self.cfg, self.dims, self.used = ckpt, cfg, dims(cfg), set()

    def present(self, recipe: Recipe, prefix: str) -> bool:
        if isinstance(recipe, Src):
            return prefix + recipe.key.format(e=0) in self.ckpt
        if isinstance(recipe, Cat):
            return all(self.present(p, prefix) for p in recipe.parts)
        return any(self.present(o, prefix) for o in recipe.options)

    def keys(self, recipe: Recipe, prefix: str) -> list[str]:
        if isinstance(recipe, Src):
            return [prefix + recipe.key.format(e="{e}")]
        if isinstance(recipe, Cat):
            return [k for p in recipe.parts for k in self.keys(p, prefix)]
        return self.keys(recipe.options[0], prefix)

    def load(self, recipe: Recipe, prefix: str, dtype) -> np.ndarray:
        if isinstance(recipe, OneOf):
            for option in recipe.options:
                if self.present(option, prefix):
                    return self.load(option, prefix, dtype)
            return self.load(recipe.options[0], prefix, dtype)  # raises "missing" for the usual encoding
        if _per_expert(recipe):
            return np.stack([self._load_one(recipe, prefix, dtype, e) for e in range(self.cfg.moe_num_experts)])
        return self._load_one(recipe, prefix, dtype, None)

    def _load_one(self, recipe: Recipe, prefix: str, dtype, e: int | None) -> np.ndarray:
        if isinstance(recipe, Cat):
            return np.concatenate([self._load_one(p, prefix, dtype, e) for p in recipe.parts], axis=-1)
        assert isinstance(recipe, Src)
        key = prefix + recipe.key.format(e=e)
        if key not in self.ckpt:
            raise CheckpointError(f"missing tensor {key!r} in checkpoint {self.ckpt.path}")
        info = self.ckpt.info(key)
        want = tuple(self.dims[d] for d in recipe.shape)
        if info.shape != want:
            meaning = ", ".join(DIM_MEANING[d] for d in recipe.shape)
            raise CheckpointError(f"tensor {key!r} in {info.file} has shape {list(info.shape)}, expected "
                                  f"{list(want)} ({meaning})")
        if info.dtype not in FLOAT_STORAGE:
            raise CheckpointError(f"tensor {key!r} in {info.file} is stored as {info.dtype}; a floating-point "
                                  f"weight ({'/'.join(sorted(FLOAT_STORAGE))}) was expected")
        self.used.add(key)
        arr = self.ckpt.read(key)
        if recipe.squeeze:
            arr = arr.reshape(arr.shape[1:])
        if recipe.transpose:
            arr = np.swapaxes(arr, -1, -2)
        return np.asarray(arr, dtype=dtype)


def _per_expert(recipe: Recipe) -> bool:
    if isinstance(recipe, Src):
        return "{e}" in recipe.key
    if isinstance(recipe, Cat):
        return any(_per_expert(p) for p in recipe.parts)
    return False


def _layer_weights(rd: _Reader, layout: Layout, prefix: str, kind: str, dtype) -> dict[str, np.ndarray]:
    out = {}
    for name in layer_shapes(rd.cfg, kind):
        out[name] = rd.load(layout.layer[name], prefix, np.float32 if name in F32_LEAVES else dtype)
    return out


def read_weights(path: str, cfg: ErnieConfig, dtype=jnp.bfloat16) -> tuple[dict[str, Any], ErnieConfig, str]:
    """Host (numpy) weights pytree of a checkpoint, the config (MTP switched on if the files carry it), and
    the layout name."""
    ckpt = SafetensorsCheckpoint(path)
    keys = set(ckpt.keys())
    layout = detect_layout(keys, path)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)

    mtp_present = any(k.startswith(layout.mtp_layer_prefix) for k in keys) or any(
        rd_key in keys for rd_key in (r.key for r in layout.mtp.values() if isinstance(r, Src)))
    if mtp_present != cfg.has_mtp:
        # The files decide: a config without `num_nextn_predict_layers` may still ship the MTP block, and a
        # checkpoint may leave it out (the model then simply has no MTP head).
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(mtp_present))
    if cfg.tie_word_embeddings and "lm_head.weight" in keys:
        raise CheckpointError(f"{path}: config.json says tie_word_embeddings=true but the checkpoint has its own "
                              "'lm_head.weight'; fix the config rather than silently ignoring either")

    rd = _Reader(ckpt, cfg)
    weights: dict[str, Any] = {
        "embed": rd.load(layout.top["embed"], "", np_dtype),
        "final_norm": rd.load(layout.top["final_norm"], "", np_dtype),
        "segments": [],
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = rd.load(layout.top["lm_head"], "", np_dtype)
    for seg in cfg.layer_segments():
        layers = [_layer_weights(rd, layout, layout.layer_prefix.format(i=i), seg.kind, np_dtype)
                  for i in range(seg.start, seg.start + seg.count)]
        weights["segments"].append({k: np.stack([lw[k] for lw in layers]) for k in layers[0]})
    if cfg.has_mtp:
        mtp = {name: rd.load(r, "", np_dtype) for name, r in layout.mtp.items()}
        mtp["layer"] = _layer_weights(rd, layout, layout.mtp_layer_prefix, "dense", np_dtype)
        weights["mtp"] = mtp

    unexpected = sorted(keys - rd.used)
    if unexpected:
        where = ckpt.info(unexpected[0]).file
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} for this config, e.g. "
                              f"{unexpected[:5]} (in {os.path.basename(where)}); the config and the checkpoint "
                              "do not describe the same model")
    return weights, cfg, layout.name


def load_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16):
    """Load an ERNIE-4.5 MoE checkpoint folder (Paddle release or HF layout, one file or sharded).

    dtype: the activation and weight dtype (bf16 default; f32 for exact parity checks). The router and its
    correction bias are always f32.
    """
    from ernie_jax.model.ernie import ErnieForCausalLM

    path = os.fspath(path)
    cfg = ErnieConfig.from_pretrained(path)
    weights, cfg, _ = read_weights(path, cfg, dtype)
    return ErnieForCausalLM(cfg, _to_device(weights), dtype=dtype)


def _to_device(tree):
    if isinstance(tree, dict):
        return {k: _to_device(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v) for v in tree]
    return jnp.asarray(tree)
