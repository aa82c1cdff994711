"""CheckpointPlan: every tensor a checkpoint must provide for a config, validated before any data is read.

The plan walks the layout tables (layouts.py) for a config and lists one `TensorTask` per weight (one per
expert for expert weights, so streaming converters never hold a whole expert stack). `validate()` checks
names, shapes and storage dtypes from the safetensors headers alone and raises one `CheckpointError`
naming the tensor and file; `read(task)` then returns the tensor (numpy, `BlockFP8` for the FP8 release's
`quant_weight` + `weight_scale` pairs, or `IntWeight` for an integer checkpoint's, converters.quantize_int). Loading, converting and `--dry-run` reports all use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import numpy as np

from ernie_jax.checkpoint.layouts import DIM_MEANING, Layout, OneOf, Recipe, Src, detect_layout, dims
from ernie_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from ernie_jax.config import INT_SCHEMES, ErnieConfig
from ernie_jax.model.weights import EXPERT_LEAVES, F32_LEAVES, QUANTIZABLE, group_problem, int_format, layer_shapes
from ernie_jax.quant import FP8_MAX, BlockFP8, IntWeight, packed_rows, scale_rows, scale_shape

FLOAT_STORAGE = {"F32", "BF16", "U16", "F16", "F64"}
FP8_STORAGE = {"I8", "U8", "F8_E4M3"}
INT_STORAGE = {"I8"}


@dataclasses.dataclass(frozen=True)
class TensorTask:
    """One weight to read. `path` is its place in the per-layer (unstacked) tree:
    ("embed",), ("layers", i, leaf), ("layers", i, leaf, e), ("mtp", name) or ("mtp", "layer", leaf)."""

    path: tuple
    recipe: Recipe  # OneOf already resolved
    prefix: str
    leaf: str
    expert: int | None = None

    @property
    def kind(self) -> str:
        """A coarse category for reports."""
        if self.path[0] == "mtp":
            return "mtp"
        if self.leaf in ("qkv", "o"):
            return "attention"
        if self.leaf.startswith("experts"):
            return "experts"
        if self.leaf.startswith("shared"):
            return "shared_experts"
        if self.leaf in ("up_gate", "down"):
            return "dense_ffn"
        if self.leaf.startswith("router"):
            return "router"
        if self.leaf in ("k_scale", "v_scale"):
            return "kv_cache_scales"
        return {"embed": "embedding", "lm_head": "lm_head"}.get(self.leaf, "norms")


def _srcs(recipe: Recipe) -> list[Src]:
    return [recipe] if isinstance(recipe, Src) else [s for p in recipe.parts for s in _srcs(p)]


def _per_expert(recipe: Recipe) -> bool:
    return any("{e}" in s.key for s in _srcs(recipe))


class CheckpointPlan:
    def __init__(self, path: str, cfg: ErnieConfig, ckpt: SafetensorsCheckpoint | None = None):
        self.path = os.fspath(path)
        self.ckpt = ckpt or SafetensorsCheckpoint(self.path)
        keys = set(self.ckpt.keys())
        self.layout: Layout = detect_layout(keys, self.path)
        mtp_present = any(k.startswith(self.layout.mtp_layer_prefix) for k in keys) or any(
            s.key in keys for r in self.layout.mtp.values() for s in _srcs(r))
        if mtp_present != cfg.has_mtp:
            # The files decide: a config without `num_nextn_predict_layers` may still ship the MTP block, and a
            # checkpoint may leave it out (the model then simply has no MTP head).
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(mtp_present))
        if cfg.tie_word_embeddings and "lm_head.weight" in keys:
            raise CheckpointError(f"{self.path}: config.json says tie_word_embeddings=true but the checkpoint has "
                                  "its own 'lm_head.weight'; fix the config rather than silently ignoring either")
        self.cfg = cfg
        self.dims = dims(cfg)
        self.json_scales = _read_kv_scale_json(self.path, cfg)
        self.tasks = list(self._tasks())

    # ---- enumeration ------------------------------------------------------------------------------------
    def _resolve(self, recipe: Recipe, prefix: str) -> Recipe:
        if not isinstance(recipe, OneOf):
            return recipe
        for option in recipe.options:
            if all(prefix + s.key.format(e=0) in self.ckpt for s in _srcs(option)):
                return option
        return recipe.options[0]  # validation then reports its tensors as missing

    def _leaf_tasks(self, path: tuple, recipe: Recipe, prefix: str, leaf: str) -> Iterator[TensorTask]:
        recipe = self._resolve(recipe, prefix)
        if _per_expert(recipe):
            for e in range(self.cfg.moe_num_experts):
                yield TensorTask(path + (e,), recipe, prefix, leaf, e)
        else:
            yield TensorTask(path, recipe, prefix, leaf)

    def _layer_tasks(self, path: tuple, prefix: str, kind: str) -> Iterator[TensorTask]:
        for leaf in layer_shapes(self.cfg, kind):
            yield from self._leaf_tasks(path + (leaf,), self.layout.layer[leaf], prefix, leaf)
        for leaf, recipe in self.layout.kv_scales.items():  # optional: static FP8 KV-cache scales
            key = prefix + recipe.key
            if key in self.ckpt or key in self.json_scales:
                yield TensorTask(path + (leaf,), recipe, prefix, leaf)

    def _tasks(self) -> Iterator[TensorTask]:
        top = self.layout.top
        yield from self._leaf_tasks(("embed",), top["embed"], "", "embed")
        yield from self._leaf_tasks(("final_norm",), top["final_norm"], "", "final_norm")
        if not self.cfg.tie_word_embeddings:
            yield from self._leaf_tasks(("lm_head",), top["lm_head"], "", "lm_head")
        for i in range(self.cfg.num_hidden_layers):
            kind = "moe" if self.cfg.is_moe_layer(i) else "dense"
            yield from self._layer_tasks(("layers", i), self.layout.layer_prefix.format(i=i), kind)
        if self.cfg.has_mtp:
            for name, recipe in self.layout.mtp.items():
                yield from self._leaf_tasks(("mtp", name), recipe, "", name)
            yield from self._layer_tasks(("mtp", "layer"), self.layout.mtp_layer_prefix, "dense")

    # ---- names, shapes and dtypes -----------------------------------------------------------------------
    def keys_of(self, task: TensorTask) -> list[tuple[str, tuple[int, ...], str, Src]]:
        """(stored name, expected shape, storage class, source) of each tensor the task reads; storage class is
        "float", "fp8", "int" or "scale". A quantizable weight is read quantized when its quant_weight is
        present, as the config's quantization_config says (block FP8, or integers)."""
        out = []
        for s in _srcs(task.recipe):
            key = task.prefix + s.key.format(e=task.expert)
            shape = tuple(self.dims[d] for d in s.shape)
            qkey = key[: -len(".weight")] + ".quant_weight"
            skey = key[: -len(".weight")] + ".weight_scale"
            if key.endswith(".weight") and qkey in self.ckpt:
                fmt = self._int_format(qkey, task.leaf)
                if fmt is None:
                    block = self._block(qkey)
                    out += [(qkey, shape, "fp8", s), (skey, scale_shape(shape, block), "scale", s)]
                else:
                    bits, group, _ = fmt
                    *lead, K, N = shape
                    out += [(qkey, (*lead, packed_rows(K, bits), N), "int", s),
                            (skey, (*lead, scale_rows(K, group), N), "scale", s)]
            else:
                out.append((key, shape, "float", s))
        return out

    def _int_format(self, qkey: str, leaf: str) -> tuple[int, int, str] | None:
        """(bits, group, compute) when the config says `leaf` is stored as integers, None for block FP8."""
        qc = self.cfg.quantization_config
        if qc is None:
            return None  # _block names the missing quantization_config
        field = "moe_quant_type" if leaf in EXPERT_LEAVES else "dense_quant_type"
        scheme = qc.scheme_of(leaf in EXPERT_LEAVES)
        if scheme in INT_SCHEMES:
            try:
                return int_format(scheme, leaf, qc.weight_group_size)
            except ValueError as e:
                raise CheckpointError(f"{self.path}: quantization_config: {e}") from None
        if scheme not in (None, "block_wise_fp8"):
            raise CheckpointError(f"{self.path}: quantization_config.{field} {scheme!r} (for {qkey!r}) is not a "
                                  f"stored format ernie_jax reads: block_wise_fp8 or one of {list(INT_SCHEMES)}")
        return None

    def _block(self, qkey: str) -> int:
        qc = self.cfg.quantization_config
        if qc is None:
            raise CheckpointError(f"{self.path}: the checkpoint holds block-FP8 tensors (e.g. {qkey!r}) but "
                                  "config.json has no 'quantization_config'; without it the FP8 format cannot be "
                                  "confirmed")
        if qc.weight_block_size[0] != qc.weight_block_size[1]:
            raise CheckpointError(f"quantization_config.weight_block_size {list(qc.weight_block_size)}: only "
                                  "square blocks are supported")
        return qc.weight_block_size[0]

    def validate(self) -> None:
        """Check every tensor against the config (headers only); raise one error naming the first problem."""
        used: set[str] = set()
        for task in self.tasks:
            for key, shape, storage, src in self.keys_of(task):
                used.add(key)
                if key in self.json_scales:
                    continue
                if key not in self.ckpt:
                    raise CheckpointError(f"missing tensor {key!r} in checkpoint {self.path}")
                if storage in ("fp8", "int") and (task.leaf not in QUANTIZABLE or src.transpose):
                    raise CheckpointError(f"tensor {key!r} is quantized, but {task.leaf!r} weights are never "
                                          "quantized (embeddings, norms, the router and the LM head stay)")
                info = self.ckpt.info(key)
                if info is None:  # index-only dry run: names are all we have
                    continue
                squeezed = src.squeeze and info.shape == shape[1:]  # a [1,E] bias stored as [E]
                if info.shape != shape and not squeezed:
                    meaning = ", ".join(DIM_MEANING[d] for d in src.shape) if storage == "float" \
                        else f"the f32 scales of {task.leaf}" if storage == "scale" \
                        else f"{task.leaf}'s integers, 4-bit ones two per byte along `in`" if storage == "int" \
                        else task.leaf
                    raise CheckpointError(f"tensor {key!r} in {info.file} has shape {list(info.shape)}, expected "
                                          f"{list(shape)} ({meaning})")
                allowed = {"fp8": FP8_STORAGE, "int": INT_STORAGE}.get(storage, FLOAT_STORAGE)
                if info.dtype not in allowed:
                    what = "a quant_weight must hold float8 e4m3fn bits" if storage == "fp8" else \
                        "an integer quant_weight must be int8" if storage == "int" else \
                        "weight_scale must be F32" if storage == "scale" else "a floating-point weight was expected"
                    raise CheckpointError(f"tensor {key!r} in {info.file} is stored as {info.dtype}; {what} "
                                          f"({'/'.join(sorted(allowed))})")
        stray = sorted(set(self.json_scales) - used)
        if stray:
            raise CheckpointError(f"{self.path}/kv_cache_scale.json: keys that name no attention layer of this "
                                  f"model: {stray[:5]}")
        unexpected = sorted(set(self.ckpt.keys()) - used)
        if unexpected:
            info = self.ckpt.info(unexpected[0])
            where = f" (in {os.path.basename(info.file)})" if info is not None else ""
            raise CheckpointError(f"{len(unexpected)} unexpected tensor(s) in {self.path} for this config, e.g. "
                                  f"{unexpected[:5]}{where}; the config and the checkpoint do not describe the "
                                  "same model")

    # ---- reading ----------------------------------------------------------------------------------------
    def read(self, task: TensorTask, dtype) -> np.ndarray | BlockFP8 | IntWeight:
        """The task's tensor: numpy in `dtype` (f32 for router and scales), or BlockFP8 / IntWeight as stored."""
        dtype = np.float32 if task.leaf in F32_LEAVES else dtype
        if task.leaf in ("k_scale", "v_scale"):
            key = task.prefix + task.recipe.key
            if key in self.json_scales:  # kv_cache_scale.json stores the dequant multiplier absmax/448
                return self.json_scales[key]
            return np.asarray(self.ckpt.read(key), np.float32).reshape(-1) / FP8_MAX  # tensors store the absmax
        parts = []
        for key, _, storage, src in self.keys_of(task):
            if storage == "scale":
                continue
            if storage == "fp8":
                skey = key[: -len(".quant_weight")] + ".weight_scale"
                return BlockFP8(np.asarray(self.ckpt.read(key)), np.asarray(self.ckpt.read(skey), np.float32),
                                block=self._block(key))
            if storage == "int":
                skey = key[: -len(".quant_weight")] + ".weight_scale"
                bits, group, compute = self._int_format(key, task.leaf)
                rows = self.dims[src.shape[-2]]
                # I8 tensors read as e4m3fn bit patterns (the FP8 release's convention): view the bits as int8.
                values = np.asarray(self.ckpt.read(key)).view(np.int8)
                return IntWeight(values, np.asarray(self.ckpt.read(skey), np.float32),
                                 bits, group, rows, compute)
            arr = self.ckpt.read(key)
            if src.squeeze:
                arr = arr.reshape(arr.shape[-1:])
            if src.transpose:
                arr = np.swapaxes(arr, -1, -2)
            parts.append(np.asarray(arr, dtype=dtype))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    def check_groups(self, scheme: str | None, group: int) -> None:
        """Before any data is read: raise naming the first stored linear whose input rows scale groups of
        `group` (`scheme`'s 4-bit weights) do not tile."""
        if scheme is None or scheme == "fp8":
            return
        for task in self.tasks:
            if task.leaf not in QUANTIZABLE:
                continue
            for key, _, _, src in self.keys_of(task):
                why = group_problem(int_format(scheme, task.leaf, group)[1], self.dims[src.shape[-2]], repr(key))
                if why:
                    raise CheckpointError(f"{self.path}: {why}")

    def nbytes(self) -> int:
        return sum(self.ckpt.info(k).nbytes for t in self.tasks for k, _, _, _ in self.keys_of(t)
                   if k in self.ckpt and self.ckpt.info(k) is not None)


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


def stack(items: list) -> np.ndarray | BlockFP8 | IntWeight:
    """np.stack that also stacks BlockFP8 and IntWeight leaves (values and scales separately)."""
    kinds = {type(i) if isinstance(i, (BlockFP8, IntWeight)) else np.ndarray for i in items}
    if len(kinds) > 1:
        raise CheckpointError("a stacked weight mixes quantized and floating-point tensors (some layers or experts "
                              "quantized, others not)")
    first = items[0]
    if isinstance(first, (BlockFP8, IntWeight)):
        return dataclasses.replace(first, values=np.stack([i.values for i in items]),
                                   scales=np.stack([i.scales for i in items]))
    return np.stack(items)
