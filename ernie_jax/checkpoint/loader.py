"""`load_pretrained`: a checkpoint folder -> an `ErnieForCausalLM`, through the layout tables.

Every stored tensor is checked against the shape the config implies before it is used; missing,
unexpected, misshaped or wrongly typed tensors raise one `CheckpointError` naming the tensor, its file,
and the expected and found shapes. Nothing is guessed: an unknown layout is refused (layouts.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ernie_jax.checkpoint.layouts import DIM_MEANING, Cat, Layout, OneOf, Recipe, Src, detect_layout, dims
from ernie_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from ernie_jax.config import ErnieConfig
from ernie_jax.model.weights import F32_LEAVES, QUANTIZABLE, layer_shapes, quantize_weights
from ernie_jax.quant import COMPUTE_MODES, FP8_MAX, BlockFP8, scale_shape

FLOAT_STORAGE = {"F32", "BF16", "U16", "F16", "F64"}
FP8_STORAGE = {"I8", "U8", "F8_E4M3"}


class _Reader:
    """Evaluates recipes against one checkpoint and remembers which tensors were consumed."""

    def __init__(self, ckpt: SafetensorsCheckpoint, cfg: ErnieConfig, json_scales: dict[str, np.ndarray]):
        self.ckpt, self.cfg, self.dims, self.used = ckpt, cfg, dims(cfg), set()
        self.json_scales = dict(json_scales)

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

    def load(self, recipe: Recipe, prefix: str, dtype, leaf: str = "") -> np.ndarray | BlockFP8:
        if isinstance(recipe, OneOf):
            for option in recipe.options:
                if self.present(option, prefix):
                    return self.load(option, prefix, dtype, leaf)
            return self.load(recipe.options[0], prefix, dtype, leaf)  # raises "missing" for the usual encoding
        if _per_expert(recipe):
            return stack([self._load_one(recipe, prefix, dtype, e, leaf) for e in range(self.cfg.moe_num_experts)])
        return self._load_one(recipe, prefix, dtype, None, leaf)

    def _load_one(self, recipe: Recipe, prefix: str, dtype, e: int | None, leaf: str) -> np.ndarray | BlockFP8:
        if isinstance(recipe, Cat):
            return np.concatenate([self._load_one(p, prefix, dtype, e, leaf) for p in recipe.parts], axis=-1)
        assert isinstance(recipe, Src)
        key = prefix + recipe.key.format(e=e)
        qkey = key[: -len(".weight")] + ".quant_weight"
        if key.endswith(".weight") and qkey in self.ckpt:
            return self._load_fp8(recipe, qkey, key[: -len(".weight")] + ".weight_scale", leaf)
        if key not in self.ckpt:
            raise CheckpointError(f"missing tensor {key!r} in checkpoint {self.ckpt.path}")
        info = self.ckpt.info(key)
        want = tuple(self.dims[d] for d in recipe.shape)
        squeeze = recipe.squeeze and info.shape != want[1:]  # a [1,E] bias may also be stored as [E]
        if info.shape != want and not (recipe.squeeze and info.shape == want[1:]):
            meaning = ", ".join(DIM_MEANING[d] for d in recipe.shape)
            raise CheckpointError(f"tensor {key!r} in {info.file} has shape {list(info.shape)}, expected "
                                  f"{list(want)} ({meaning})")
        if info.dtype not in FLOAT_STORAGE:
            raise CheckpointError(f"tensor {key!r} in {info.file} is stored as {info.dtype}; a floating-point "
                                  f"weight ({'/'.join(sorted(FLOAT_STORAGE))}) was expected")
        self.used.add(key)
        arr = self.ckpt.read(key)
        if squeeze:
            arr = arr.reshape(arr.shape[1:])
        if recipe.transpose:
            arr = np.swapaxes(arr, -1, -2)
        return np.asarray(arr, dtype=dtype)


    def _load_fp8(self, recipe: Src, qkey: str, skey: str, leaf: str) -> BlockFP8:
        """`X.quant_weight` (e4m3fn bits as I8/U8/F8_E4M3, bitcast) + `X.weight_scale` (f32 per 128x128)."""
        q = self.ckpt.info(qkey)
        if leaf not in QUANTIZABLE or recipe.transpose:
            raise CheckpointError(f"tensor {qkey!r} in {q.file} is block-quantized, but {leaf!r} weights are "
                                  "never quantized in the FP8 release")
        qc = self.cfg.quantization_config
        if qc is None:
            raise CheckpointError(f"{self.ckpt.path}: the checkpoint holds block-FP8 tensors (e.g. {qkey!r}) but "
                                  "config.json has no 'quantization_config'; without it the FP8 format cannot be "
                                  "confirmed")
        block = qc.weight_block_size[0]
        if qc.weight_block_size[0] != qc.weight_block_size[1]:
            raise CheckpointError(f"quantization_config.weight_block_size {list(qc.weight_block_size)}: only "
                                  "square blocks are supported")
        want = tuple(self.dims[d] for d in recipe.shape)
        if q.dtype not in FP8_STORAGE:
            raise CheckpointError(f"tensor {qkey!r} in {q.file} is stored as {q.dtype}; a quant_weight must hold "
                                  f"float8 e4m3fn bits ({'/'.join(sorted(FP8_STORAGE))})")
        if q.shape != want:
            raise CheckpointError(f"tensor {qkey!r} in {q.file} has shape {list(q.shape)}, expected {list(want)}")
        if skey not in self.ckpt:
            raise CheckpointError(f"missing tensor {skey!r} (the scales of {qkey!r}) in checkpoint {self.ckpt.path}")
        sc = self.ckpt.info(skey)
        if sc.shape != scale_shape(want, block):
            raise CheckpointError(f"tensor {skey!r} in {sc.file} has shape {list(sc.shape)}, expected "
                                  f"{list(scale_shape(want, block))} (one f32 scale per {block}x{block} block of "
                                  f"{list(want)})")
        if sc.dtype not in FLOAT_STORAGE:
            raise CheckpointError(f"tensor {skey!r} in {sc.file} is stored as {sc.dtype}; weight_scale must be F32")
        self.used.update((qkey, skey))
        return BlockFP8(np.asarray(self.ckpt.read(qkey)), np.asarray(self.ckpt.read(skey), np.float32),
                        block=block)


def stack(items: list) -> np.ndarray | BlockFP8:
    """np.stack that also stacks BlockFP8 leaves (values and scales separately)."""
    kinds = {isinstance(i, BlockFP8) for i in items}
    if len(kinds) > 1:
        raise CheckpointError("a stacked weight mixes block-FP8 and floating-point tensors (some layers or experts "
                              "quantized, others not)")
    if kinds == {True}:
        return BlockFP8(np.stack([i.values for i in items]), np.stack([i.scales for i in items]),
                        block=items[0].block)
    return np.stack(items)


def _per_expert(recipe: Recipe) -> bool:
    if isinstance(recipe, Src):
        return "{e}" in recipe.key
    if isinstance(recipe, Cat):
        return any(_per_expert(p) for p in recipe.parts)
    return False


def _layer_weights(rd: _Reader, layout: Layout, prefix: str, kind: str, dtype) -> dict[str, np.ndarray]:
    out = {}
    for name in layer_shapes(rd.cfg, kind):
        out[name] = rd.load(layout.layer[name], prefix, np.float32 if name in F32_LEAVES else dtype, name)
    for name, recipe in layout.kv_scales.items():
        key = prefix + recipe.key
        if key in rd.json_scales:  # kv_cache_scale.json stores the dequant multiplier absmax/448
            out[name] = rd.json_scales.pop(key)
        elif rd.present(recipe, prefix):  # checkpoint tensors store the absmax
            out[name] = rd.load(recipe, prefix, np.float32, name) / FP8_MAX
    return out


def _read_kv_scale_json(path: str, cfg: ErnieConfig) -> dict[str, np.ndarray]:
    file = os.path.join(path, "kv_cache_scale.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            raw = json.load(f)
        out = {k: np.asarray(v, np.float32).reshape(-1) for k, v in raw.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: not a JSON object of per-KV-head scale lists ({e})") from None
    for k, v in out.items():
        if v.shape != (cfg.num_key_value_heads,):
            raise CheckpointError(f"{file}: {k!r} has {v.size} values, expected num_key_value_heads = "
                                  f"{cfg.num_key_value_heads}")
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

    rd = _Reader(ckpt, cfg, _read_kv_scale_json(path, cfg) if os.path.isdir(path) else {})
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
        names = set(layers[0])
        if any(set(lw) != names for lw in layers):
            raise CheckpointError(f"{path}: static KV-cache scales (cachek/cachev_matmul.activation_scale) are "
                                  f"given for some layers of {seg.start}..{seg.start + seg.count - 1} but not all")
        weights["segments"].append({k: stack([lw[k] for lw in layers]) for k in layers[0]})
    if cfg.has_mtp:
        mtp = {name: rd.load(r, "", np_dtype, name) for name, r in layout.mtp.items()}
        mtp["layer"] = _layer_weights(rd, layout, layout.mtp_layer_prefix, "dense", np_dtype)
        weights["mtp"] = mtp

    if rd.json_scales:
        raise CheckpointError(f"{path}/kv_cache_scale.json: keys that name no attention layer of this model: "
                              f"{sorted(rd.json_scales)[:5]}")
    unexpected = sorted(keys - rd.used)
    if unexpected:
        where = ckpt.info(unexpected[0]).file
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {path} for this config, e.g. "
                              f"{unexpected[:5]} (in {os.path.basename(where)}); the config and the checkpoint "
                              "do not describe the same model")
    return weights, cfg, layout.name


def load_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *, quantization: str | None = None,
                    fp8_compute: str = "w8a8"):
    """Load an ERNIE-4.5 MoE checkpoint folder (Paddle release or HF layout, one file or sharded).

    dtype: the activation and floating-point weight dtype (bf16 default; f32 for exact parity checks). The
    router and its correction bias are always f32.
    quantization: None keeps the checkpoint's weights as stored (an FP8 release stays FP8); "fp8"
    block-quantizes a BF16 checkpoint's linears at load time.
    fp8_compute: numerics of the FP8 linears, "w8a8" (default, FastDeploy's) or "weight_only" (see quant.py).
    """
    from ernie_jax.model.ernie import ErnieForCausalLM

    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r}: expected None or 'fp8'")
    if fp8_compute not in COMPUTE_MODES:
        raise ValueError(f"fp8_compute={fp8_compute!r}: expected one of {COMPUTE_MODES}")
    path = os.fspath(path)
    cfg = ErnieConfig.from_pretrained(path)
    weights, cfg, _ = read_weights(path, cfg, dtype)
    weights = jax.tree.map(jnp.asarray, weights)
    if quantization == "fp8" or _has_fp8(weights):
        weights = quantize_weights(weights, fp8_compute)
    return ErnieForCausalLM(cfg, weights, dtype=dtype)


def _has_fp8(weights) -> bool:
    return any(isinstance(x, BlockFP8) for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, BlockFP8)))
