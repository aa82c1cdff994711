"""The weights pytree: its structure, shapes, dtypes, random init and parameter counts.

Owns the one canonical layout that loaders fill and the forward pass reads (a plain nested dict):

    embed        [V, H]
    segments[s]  one dict per LayerSegment, every leaf stacked over that segment's L layers:
        input_norm [L, H]   post_norm [L, H]   qkv [L, H, (N+2K)*D]   o [L, N*D, H]
        dense: up_gate [L, H, 2F]   down [L, F, H]
        moe:   router [L, H, E] (f32)   router_bias [L, E] (f32)
               experts_up_gate [L, E, H, 2Fm]   experts_down [L, E, Fm, H]
               (shared experts) shared_up_gate [L, H, 2Fs]   shared_down [L, Fs, H]
        optional static FP8 KV-cache scales: k_scale [L, K]  v_scale [L, K] (f32 dequant multipliers)
    final_norm   [H]
    lm_head      [H, V]            (absent when tie_word_embeddings)
    mtp          (when num_nextn_predict_layers = 1)
        emb_norm [H]  hidden_norm [H]  proj [2H, H]  layer: one dense decoder layer (no L axis)

Linears keep the Paddle [in, out] orientation so y = x @ W; fused columns are [Q|K|V] and [gate|up].
In a quantized model every QUANTIZABLE leaf is a quant.BlockFP8 ("fp8") or quant.IntWeight ("wint8", "wint4";
"w4a8": W4A8 routed experts, wint8 elsewhere), values and scales with the same leading axes.
Glossary: B batch, T tokens, H hidden, N query heads, K KV heads, D head dim, E experts, F FFN width,
V vocab, L layers in a segment, P pages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.config import ErnieConfig
from ernie_jax.quant import (FP8, SCHEMES, BlockFP8, IntWeight, is_quantized, packed_rows, quantize_block_fp8,
                             quantize_int, scale_rows, scale_shape)

# Kept in f32 whatever the model dtype: routing decisions must not change with the activation dtype.
F32_LEAVES = frozenset({"router", "router_bias", "k_scale", "v_scale"})
# The linears that the FP8 release stores block-quantized (embedding, norms, router and LM head stay).
QUANTIZABLE = frozenset({"qkv", "o", "up_gate", "down", "experts_up_gate", "experts_down", "shared_up_gate",
                         "shared_down", "proj"})
# The routed experts' leaves, [E, ...] per layer.
EXPERT_LEAVES = frozenset({"experts_up_gate", "experts_down"})


def layer_shapes(cfg: ErnieConfig, kind: str) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's leaves (no layer axis)."""
    H = cfg.hidden_size
    shapes = {
        "input_norm": (H,),
        "post_norm": (H,),
        "qkv": (H, cfg.q_size + 2 * cfg.kv_size),
        "o": (cfg.q_size, H),
    }
    if kind == "dense":
        shapes["up_gate"] = (H, 2 * cfg.intermediate_size)
        shapes["down"] = (cfg.intermediate_size, H)
    else:
        E, Fm = cfg.moe_num_experts, cfg.moe_intermediate_size
        shapes["router"] = (H, E)
        shapes["router_bias"] = (E,)
        shapes["experts_up_gate"] = (E, H, 2 * Fm)
        shapes["experts_down"] = (E, Fm, H)
        if cfg.moe_num_shared_experts:
            Fs = cfg.shared_intermediate_size
            shapes["shared_up_gate"] = (H, 2 * Fs)
            shapes["shared_down"] = (Fs, H)
    return shapes


def weight_shapes(cfg: ErnieConfig) -> dict[str, Any]:
    """The full pytree of shapes (tuples), same structure as the weights."""
    H, V = cfg.hidden_size, cfg.vocab_size
    tree: dict[str, Any] = {
        "embed": (V, H),
        "segments": [
            {k: (seg.count, *s) for k, s in layer_shapes(cfg, seg.kind).items()} for seg in cfg.layer_segments()
        ],
        "final_norm": (H,),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (H, V)
    if cfg.has_mtp:
        tree["mtp"] = {"emb_norm": (H,), "hidden_norm": (H,), "proj": (2 * H, H),
                       "layer": layer_shapes(cfg, "dense")}
    return tree


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def leaf_dtype(path_key: str, dtype) -> Any:
    return jnp.float32 if path_key in F32_LEAVES else dtype


def int_format(scheme: str, leaf: str, group: int = -1) -> tuple[int, int, str]:
    """(bits, group size, compute) of QUANTIZABLE leaf `leaf` under integer scheme `scheme`. W4A8 is for the
    routed experts (most of the bytes); the other linears take wint8, as FastDeploy's W4A8 deployments do."""
    if scheme == "wint8":
        return 8, -1, "weight_only"
    if scheme == "wint4":
        return 4, group, "weight_only"
    if scheme == "w4a8":
        return (4, -1, "w4a8") if leaf in EXPERT_LEAVES else (8, -1, "weight_only")
    raise ValueError(f"quantization={scheme!r}: expected one of {SCHEMES}")


def group_problem(group: int, rows: int, name: str) -> str | None:
    """Why scale groups of `group` input rows cannot quantize weight `name` of `rows` input rows, or None.
    The integer format itself takes a partial last group (quant/int_weights.py), but a checkpoint's scale
    groups must tile its linears exactly, as FastDeploy's do, so a shard of whole groups is a shard of rows."""
    if group == -1 or rows % group == 0:
        return None
    return (f"quant_group_size={group} does not divide the {rows} input rows of {name}; choose a group size "
            "that divides every quantized linear's input rows, or -1 (per output channel)")


def abstract_weights(cfg: ErnieConfig, dtype=jnp.bfloat16, quantization: str | None = None,
                     group: int = -1) -> dict[str, Any]:
    """ShapeDtypeStructs for every leaf: for AOT compilation and memory plans without allocation."""
    def to_sds(path, shape):
        name = _last_key(path)
        if quantization == "fp8" and name in QUANTIZABLE:
            return BlockFP8(jax.ShapeDtypeStruct(shape, FP8), jax.ShapeDtypeStruct(scale_shape(shape), jnp.float32))
        if quantization and name in QUANTIZABLE:
            bits, g, compute = int_format(quantization, name, group)
            *lead, K, N = shape
            return IntWeight(jax.ShapeDtypeStruct((*lead, packed_rows(K, bits), N), jnp.int8),
                             jax.ShapeDtypeStruct((*lead, scale_rows(K, g), N), jnp.float32), bits, g, K, compute)
        return jax.ShapeDtypeStruct(shape, leaf_dtype(name, dtype))
    return jax.tree_util.tree_map_with_path(to_sds, weight_shapes(cfg), is_leaf=_is_shape)


def quantize_weights(weights: dict[str, Any], compute: str = "w8a8", scheme: str = "fp8",
                     group: int = -1) -> dict[str, Any]:
    """Quantize every QUANTIZABLE leaf under `scheme` ("fp8": block FP8 with `compute`; "wint8", "wint4",
    "w4a8": integer weights, int_format). Already block-FP8 leaves only get `compute` set; already-integer
    leaves are kept as they are."""
    def walk(tree, name="", path=""):
        if isinstance(tree, dict):
            return {k: walk(v, k, f"{path}.{k}" if path else k) for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v, name, f"{path}[{i}]") for i, v in enumerate(tree)]
        if isinstance(tree, BlockFP8):
            return tree.with_compute(compute)
        if isinstance(tree, IntWeight) or name not in QUANTIZABLE:
            return tree
        if scheme == "fp8":
            return quantize_block_fp8(tree, compute=compute)
        bits, g, mode = int_format(scheme, name, group)
        if why := group_problem(g, tree.shape[-2], f"{path} {list(tree.shape)}"):
            raise ValueError(why)
        return quantize_int(tree, bits, g, mode)
    return walk(weights)


def _last_key(path) -> str:
    for p in reversed(path):
        if isinstance(p, jax.tree_util.DictKey):
            return str(p.key)
    return ""


def init_weights(cfg: ErnieConfig, seed: int = 0, dtype=jnp.bfloat16, scale: float = 0.02) -> dict[str, Any]:
    """Random weights (for presets, tests and benchmarks): normal(0, scale), norm gains near 1.

    Drawn with numpy on the host: compiling a JAX RNG program for every leaf costs seconds on CPU.
    """
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def draw(path, shape):
        name = _last_key(path)
        if name.endswith("norm"):
            w = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
        elif name == "router_bias":
            w = 0.01 * rng.standard_normal(shape, np.float32)
        elif name == "embed":
            w = rng.standard_normal(shape, np.float32)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1
            w = rng.standard_normal(shape, np.float32) * min(scale, 1.0 / math.sqrt(fan_in))
        return jnp.asarray(w.astype(np.float32 if name in F32_LEAVES else np_dtype))

    return jax.tree_util.tree_map_with_path(draw, weight_shapes(cfg), is_leaf=_is_shape)


def param_counts(cfg: ErnieConfig) -> dict[str, int]:
    """Parameter counts: total (main model), active per token (excl. embedding, incl. lm_head), mtp."""
    shapes = weight_shapes(cfg)
    size = lambda t: sum(int(np.prod(s)) for s in jax.tree.leaves(t, is_leaf=_is_shape))  # noqa: E731
    mtp = size(shapes.pop("mtp", {}))
    total = size(shapes)
    H, V = cfg.hidden_size, cfg.vocab_size
    active = total - V * H  # the embedding is a lookup, not a matmul
    if cfg.tie_word_embeddings:
        active += V * H  # the tied head is a matmul
    per_expert = 3 * H * cfg.moe_intermediate_size
    idle = cfg.moe_num_experts - cfg.moe_k
    active -= cfg.num_moe_layers * idle * per_expert
    return {"total": total, "active": active, "mtp": mtp}


def cpu_layout(weights: dict[str, Any], expert_groups: int = 1, fp8_values: str = "float32") -> dict[str, Any]:
    """The weights as the engine runs them on XLA:CPU: each segment's stacked [L, ...] leaves split into a
    list of L per-layer pytrees (each leaf its own buffer, on the same devices and sharded like its stacked
    leaf), which forward() unrolls. XLA:CPU copies a layer's weights out of the stack on every step of a
    lax.scan (a dynamic slice feeding a matmul), which makes a bf16 decode step several times slower
    (benchmarks/RESULTS.md, "CPU measurements behind design choices"). XLA:GPU copies the routed experts'
    slice the same way (an H200 trace: RESULTS.md, "GPU check (H200)"); the GPU keeps the scan until
    per-layer buffers can be made there without the stacked copy beside them.

    expert_groups > 1 (unsharded bf16/f32 or block-FP8 routed experts; a divisor of E): each layer's
    [E, ...] expert leaves also become a tuple of that many [E/groups, ...] stacks (ops.routed_experts takes
    either form). XLA:CPU runs the groups' batched matmuls side by side, one per core, where one batched matmul
    over all experts splits each small matmul across the cores (benchmarks/RESULTS.md, "CPU measurements
    behind design choices").

    Block-FP8 values are held as `fp8_values` (f32 or bf16; exactly: every e4m3 value is both): XLA:CPU has
    no FP8 arithmetic, so an FP8 operand is converted inside every matmul, i.e. every weight at every step;
    converted once here, the matmuls compute the same numbers (tests/test_fp8.py) at 4x or 2x the bytes
    (ExecutionConfig.cpu_fp8_values picks the dtype for the CPU)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    weights = _fp8_values_as(weights, jnp.dtype(fp8_values))

    def layer_sharding(a):  # the sharding of a[i] (and of a[i, e0:e1]): a's, less the layer axis
        s = a.sharding
        if not isinstance(s, NamedSharding):
            return s
        return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]))

    def grouped(k, a):
        return (expert_groups > 1 and k in EXPERT_LEAVES and isinstance(a, (jax.Array, BlockFP8))
                and a.shape[1] % expert_groups == 0)

    def layer(seg, i):
        out = {}
        for k, a in seg.items():
            if grouped(k, a):
                n = a.shape[1] // expert_groups
                out[k] = tuple(jax.tree.map(lambda a: a[i, g * n:(g + 1) * n], a) for g in range(expert_groups))
            else:
                out[k] = jax.tree.map(lambda a: a[i], a)
        return out

    segments = []
    for seg in weights["segments"]:
        count = jax.tree.leaves(seg)[0].shape[0]
        shardings = {k: (jax.tree.map(layer_sharding, a),) * expert_groups if grouped(k, a) else jax.tree.map(layer_sharding, a)
                     for k, a in seg.items()}
        split = jax.jit(lambda seg: [layer(seg, i) for i in range(count)], out_shardings=[shardings] * count)
        segments.append(split(seg))
    return {**weights, "segments": segments}


def _fp8_values_as(weights: dict[str, Any], dtype) -> dict[str, Any]:
    """weights with every BlockFP8's values converted to `dtype` on their devices (same shardings)."""
    is_fp8 = lambda x: isinstance(x, BlockFP8)  # noqa: E731
    if not any(map(is_fp8, jax.tree.leaves(weights, is_leaf=is_quantized))):
        return weights
    widen = lambda x: dataclasses.replace(x, values=x.values.astype(dtype)) if is_fp8(x) else x  # noqa: E731
    shardings = jax.tree.map(lambda a: a.sharding, weights)
    return jax.jit(lambda w: jax.tree.map(widen, w, is_leaf=is_fp8), out_shardings=shardings)(weights)
