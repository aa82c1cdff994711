"""`load_pretrained`: a checkpoint folder -> an `ErnieForCausalLM`, through the layout tables.

Every stored tensor is checked against the shape the config implies before it is used; missing,
unexpected, misshaped or wrongly typed tensors raise one `CheckpointError` naming the tensor, its file,
and the expected and found shapes. Nothing is guessed: an unknown layout is refused (layouts.py).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from ernie_jax.checkpoint.orbax_io import is_orbax_checkpoint, read_flat
from ernie_jax.checkpoint.plan import CheckpointPlan, stack
from ernie_jax.checkpoint.safetensors_io import CheckpointError
from ernie_jax.config import ErnieConfig
from ernie_jax.model.weights import F32_LEAVES, quantize_weights
from ernie_jax.quant import COMPUTE_MODES, BlockFP8, check_scheme, is_quantized


def _host_dtype(dtype) -> np.dtype:
    """numpy's name for a JAX dtype (ml_dtypes' bfloat16 for bf16)."""
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


def read_weights(path: str, cfg: ErnieConfig, dtype=jnp.bfloat16, quantization: str | None = None,
                 quant_group_size: int = -1) -> tuple[dict[str, Any], ErnieConfig]:
    """Host (numpy) weights pytree of a safetensors checkpoint, and its config (MTP switched on or off by
    what the files carry). Everything is validated from the headers before any data is read, including
    that a load-time `quantization` has a BF16 checkpoint to quantize."""
    plan = CheckpointPlan(path, cfg)
    plan.validate()
    stored = [(key, storage) for task in plan.tasks for key, _, storage, _ in plan.keys_of(task)
              if storage in ("fp8", "int")]
    if stored:
        _refuse_requantizing(path, quantization, "fp8" if stored[0][1] == "fp8" else "integer", stored[0][0])
    plan.check_groups(quantization, quant_group_size)
    np_dtype = _host_dtype(dtype)
    flat = {task.path: plan.read(task, np_dtype) for task in plan.tasks}
    return assemble(flat, plan.cfg), plan.cfg


def assemble(flat: dict[tuple, Any], cfg: ErnieConfig) -> dict[str, Any]:
    """Per-layer tensors keyed by TensorTask.path -> the stacked weights pytree of weights.py."""
    def layer(prefix: tuple) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, value in flat.items():
            if path[: len(prefix)] == prefix and len(path) > len(prefix):
                leaf = path[len(prefix)]
                if len(path) == len(prefix) + 2:  # one expert of a stacked expert weight
                    out.setdefault(leaf, {})[path[-1]] = value
                elif len(path) == len(prefix) + 1:
                    out[leaf] = value
        return {k: stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}

    weights: dict[str, Any] = {k: flat[(k,)] for k in ("embed", "final_norm", "lm_head") if (k,) in flat}
    weights["segments"] = []
    for seg in cfg.layer_segments():
        layers = [layer(("layers", i)) for i in range(seg.start, seg.start + seg.count)]
        if any(set(lw) != set(layers[0]) for lw in layers):
            raise CheckpointError(f"static KV-cache scales (cachek/cachev_matmul.activation_scale) are given for "
                                  f"some of layers {seg.start}..{seg.start + seg.count - 1} but not all")
        weights["segments"].append({k: stack([lw[k] for lw in layers]) for k in layers[0]})
    if cfg.has_mtp:
        weights["mtp"] = {k: v for (_, k), v in ((p, v) for p, v in flat.items() if p[0] == "mtp" and len(p) == 2)}
        weights["mtp"]["layer"] = layer(("mtp", "layer"))
    return weights


def load_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *, quantization: str | None = None,
                    fp8_compute: str = "w8a8", quant_group_size: int = -1, mesh=None, sharding: str | dict = "tp_ep",
                    kernels: str = "auto"):
    """Load an ERNIE-4.5 MoE checkpoint folder (Paddle release or HF layout, one file or sharded, or an
    ernie_jax Orbax checkpoint written by converters.paddle_to_jax).

    dtype: the activation and floating-point weight dtype (bf16 default; f32 for exact parity checks). The
    router and its correction bias are always f32.
    quantization: None keeps the checkpoint's weights as stored (an FP8 or integer checkpoint stays so); "fp8"
    block-quantizes a BF16 checkpoint's linears at load time, "wint8" / "wint4" / "w4a8" quantize them to
    integers (quant/int_weights.py; model.weights.int_format says which leaf takes what).
    fp8_compute: numerics of the FP8 linears, "w8a8" (default, FastDeploy's) or "weight_only" (quant/block_fp8.py).
    quant_group_size: wint4's scales, -1 per output channel (default, FastDeploy's) or a group size along `in`.
    mesh: a jax Mesh, or a spec for sharding.make_mesh (8, "data=1,expert=4,tensor=2"); each tensor then goes
    from host memory straight to its shards under the `sharding` rules (a preset name or a rules table).
    kernels: "auto" | "pallas" | "xla", how the ops' implementations are chosen (ops/execution.py).
    """
    from ernie_jax.model.ernie import ErnieForCausalLM

    cfg, weights = read_pretrained(path, dtype, quantization=quantization, fp8_compute=fp8_compute,
                                   quant_group_size=quant_group_size)
    if mesh is None:
        return ErnieForCausalLM.from_host(cfg, weights, dtype, kernels=kernels)
    from ernie_jax.sharding import ShardingPlan, make_mesh
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    return ErnieForCausalLM.from_host(cfg, weights, dtype, ShardingPlan.create(mesh, sharding), kernels=kernels)


def read_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *, quantization: str | None = None,
                    fp8_compute: str = "w8a8", quant_group_size: int = -1) -> tuple[ErnieConfig, dict[str, Any]]:
    """A checkpoint folder's config and weights pytree in host memory (numpy), converted as load_pretrained
    describes but not yet on any device: the caller places it, e.g. once per submesh."""
    check_scheme(quantization, quant_group_size)
    if fp8_compute not in COMPUTE_MODES:
        raise ValueError(f"fp8_compute={fp8_compute!r}: expected one of {COMPUTE_MODES}")
    path = os.fspath(path)
    cfg = ErnieConfig.from_pretrained(path)
    if is_orbax_checkpoint(path):
        np_dtype = _host_dtype(dtype)
        keep = lambda p, v: is_quantized(v) or p[-1] in F32_LEAVES  # noqa: E731
        flat = {p: v if keep(p, v) else v.astype(np_dtype) for p, v in read_flat(path).items()}
        weights = assemble(flat, cfg)
        if _stored(weights):
            example = next("/".join(map(str, p)) for p, v in flat.items() if is_quantized(v))
            _refuse_requantizing(path, quantization, _stored(weights), example)
    else:
        weights, cfg = read_weights(path, cfg, dtype, quantization, quant_group_size)
    if quantization is not None or _stored(weights) == "fp8":
        weights = quantize_weights(weights, fp8_compute, quantization or "fp8", quant_group_size)
    return cfg, weights


def _refuse_requantizing(path: str, quantization: str | None, stored: str, example: str) -> None:
    """A load-time quantization takes a BF16 checkpoint (fp8 of an FP8 release only sets its compute mode)."""
    if quantization is None or quantization == stored:
        return
    raise CheckpointError(f"{path}: --quantization {quantization} quantizes a BF16 checkpoint, but this one is "
                          f"already quantized ({stored}, e.g. tensor {example!r}); serve it as stored (no "
                          "--quantization)")


def _stored(weights) -> str | None:
    """"fp8" or "integer" for weights read quantized, None for floating-point ones."""
    for x in jax.tree.leaves(weights, is_leaf=is_quantized):
        if is_quantized(x):
            return "fp8" if isinstance(x, BlockFP8) else "integer"
    return None
