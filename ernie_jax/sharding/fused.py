"""Fused [Q|K|V] and [gate|up] columns laid out for the mesh, so each tensor shard holds whole groups.

The checkpoint's fused linears hold every query head, then every KV head ([Q|K|V]), and every gate column,
then every up column ([gate|up]). Split contiguously over t tensor devices, a shard would hold query heads
without their KV heads, or gate columns without their up columns, and XLA would reshard the activation
before attention and before silu(gate) * up: collectives in every layer. On a plan with `fused_layout`,
`placement.shard_weights` re-lays these leaves as t groups, [Q_i|K_i|V_i] and [gate_i|up_i], so the
contiguous split hands device i group i, and the forward splits the fused output group by group
(`split_fused`). One group is the checkpoint layout. A model whose heads or columns the mesh cannot split
into whole groups (e.g. 2 KV heads on 8 devices, or FP8 groups that are not whole 128-column scale blocks)
has that block (attention, or the dense FFNs) replicated over the tensor devices instead: `fit_plan`, which
ErnieForCausalLM.from_host applies to every plan it places weights by, and the start-up log says so.
A plan without fused layouts (training's) keeps the rules as they are: such a leaf is split as the
checkpoint lays it out, and XLA reshards.
"""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np

from ernie_jax.config import ErnieConfig
from ernie_jax.quant import BlockFP8, IntWeight

log = logging.getLogger("ernie_jax.sharding")

# Fused leaf -> the logical axis its output columns are split on (rules.LEAF_AXES).
FUSED_LEAVES = {"qkv": "qkv", "up_gate": "mlp", "shared_up_gate": "mlp"}
_noted: set[tuple] = set()


def fused_parts(cfg: ErnieConfig | None, leaf: str, width: int) -> tuple[tuple[int, ...], int]:
    """(column counts of the fused parts, the columns one indivisible unit spans): [Q|K|V] splits by whole
    heads (cfg says how many), [gate|up] (of any `width`) by columns."""
    if leaf == "qkv":
        return (cfg.q_size, cfg.kv_size, cfg.kv_size), cfg.head_dim
    return (width // 2, width // 2), 1


def fused_groups(plan, cfg: ErnieConfig | None, leaf: str, w) -> int:
    """How many groups leaf `w` is laid out in under `plan` (1: the checkpoint layout)."""
    if plan is None or not plan.fused_layout:
        return 1
    t = plan.size_of(plan.axes_of(FUSED_LEAVES[leaf]))
    width = w.shape[-1]
    if t == 1 or width % t:  # unsplit, or replicated by the rules
        return 1
    why = _group_problem(cfg, leaf, w, t)
    if why is None:
        return t
    key = (leaf, tuple(w.shape), t)
    if key not in _noted:
        _noted.add(key)
        log.info("%s %s on mesh %s keeps the checkpoint's fused layout (%s): XLA reshards its output before "
                    "use", leaf, tuple(w.shape), dict(plan.mesh.shape), why)
    return 1


def _group_problem(cfg: ErnieConfig | None, leaf: str, w, t: int) -> str | None:
    """Why fused leaf w cannot be laid out as t whole groups, or None."""
    parts, unit = fused_parts(cfg, leaf, w.shape[-1])
    if any(p % (t * unit) for p in parts):
        return f"parts {parts} do not split into {t} groups of whole {'heads' if unit > 1 else 'columns'}"
    if isinstance(w, BlockFP8) and any((p // t) % w.block for p in parts):
        return f"{t} groups of {[p // t for p in parts]} columns are not whole {w.block}-column FP8 scale blocks"
    return None


# Per block: the logical axes its weights and activations split on over "tensor" (the routed experts and the
# vocabulary split on their own), the rules axis that sizes the split, and its (fused leaf, row-split leaf) pairs.
_BLOCKS = {"attention": (("qkv", "heads", "q_heads", "kv_heads"), "qkv", (("qkv", "o"),)),
           "dense FFN": (("mlp",), "mlp", (("up_gate", "down"), ("shared_up_gate", "shared_down")))}


def _split_problem(cfg: ErnieConfig, block: str, pairs, layers: list[dict], t: int) -> str | None:
    """Why a block's leaves cannot split into whole groups on t devices, or None."""
    if block == "attention" and (cfg.num_attention_heads % t or cfg.num_key_value_heads % t):
        return f"{cfg.num_attention_heads} query and {cfg.num_key_value_heads} KV heads do not both split {t} ways"
    for layer in layers:
        for fused, rows in pairs:
            if (w := layer.get(fused)) is not None and (why := _group_problem(cfg, fused, w, t)):
                return why
            if isinstance(r := layer.get(rows), BlockFP8) and (r.shape[-2] // t) % r.block:
                return f"{rows}'s {r.shape[-2]} rows are not whole {r.block}-row FP8 scale blocks on {t} devices"
    return None


def fit_plan(plan, cfg: ErnieConfig, weights: dict):
    """plan, with attention or the dense FFNs replicated over the devices their axes map to where the model's
    leaves there cannot split into whole groups per device (whole query and KV heads; [gate|up] halves; FP8
    scale blocks, the fused leaves' columns and the row-split leaves' rows alike). Split anyway, XLA would
    reshard the block's activations in every layer (tens of collectives a step for a small model on four
    devices); replicated, the block runs on each device without one, as the rules already replicate a single
    dimension the mesh does not divide. The start-up log says which block and why. No change to a plan
    without fused layouts (training keeps the checkpoint's) or where every block splits."""
    if plan is None or not plan.fused_layout:
        return plan
    layers = []
    for seg in weights["segments"]:
        layers += seg if isinstance(seg, list) else [seg]
    if "mtp" in weights:
        layers.append(weights["mtp"]["layer"])
    drop = []
    for block, (axes, axis, pairs) in _BLOCKS.items():
        t = plan.size_of(plan.axes_of(axis))
        if t > 1 and (why := _split_problem(cfg, block, pairs, layers, t)):
            drop += axes
            log.info("%s replicated over mesh axes %s of %s: %s", block, plan.axes_of(axis), dict(plan.mesh.shape), why)
    return plan if not drop else plan.without(drop)


def split_fused(y, parts: tuple[int, ...], groups: int) -> list:
    """The fused parts of y [..., C] laid out in `groups` groups -> [..., p] for each p in parts."""
    xp = np if isinstance(y, np.ndarray) else jnp
    cuts = np.cumsum([p // groups for p in parts])[:-1].tolist()
    if groups == 1:
        return xp.split(y, cuts, axis=-1)
    lead = y.shape[:-1]
    pieces = xp.split(y.reshape(*lead, groups, y.shape[-1] // groups), cuts, axis=-1)
    return [p.reshape(*lead, -1) for p in pieces]


def group_fused(parts_arrays: list, groups: int):
    """Inverse of split_fused: [..., p] per part -> [..., C] laid out in `groups` groups."""
    xp = np if all(isinstance(a, np.ndarray) for a in parts_arrays) else jnp
    if groups == 1:
        return xp.concatenate(parts_arrays, axis=-1)
    lead = parts_arrays[0].shape[:-1]
    grouped = [a.reshape(*lead, groups, a.shape[-1] // groups) for a in parts_arrays]
    return xp.concatenate(grouped, axis=-1).reshape(*lead, -1)


def _on_columns(w, fn, block: int):
    """fn applied to w's output-column axis: an array's last axis; a BlockFP8's values (their second-to-last
    axis when K-major) and scales (at block granularity); an IntWeight's values and scales (one per column)."""
    if isinstance(w, IntWeight):
        return dataclasses.replace(w, values=fn(w.values, 1), scales=fn(w.scales, 1))
    if not isinstance(w, BlockFP8):
        return fn(w, 1)
    values = fn(w.values.swapaxes(-1, -2), 1).swapaxes(-1, -2) if w.k_major else fn(w.values, 1)
    return dataclasses.replace(w, values=values, scales=fn(w.scales, block))


def relayout_fused(weights: dict, plan, cfg: ErnieConfig, to_groups: bool = True) -> dict:
    """weights with every fused leaf moved into plan's layout (to_groups) or back to the checkpoint's."""
    def leaf(name, w):
        groups = fused_groups(plan, cfg, name, w)
        if groups == 1:
            return w
        parts, _ = fused_parts(cfg, name, w.shape[-1])

        def move(a, scale):
            p = tuple(n // scale for n in parts)
            if to_groups:
                return group_fused(split_fused(a, p, 1), groups)
            return group_fused(split_fused(a, p, groups), 1)
        return _on_columns(w, move, w.block if isinstance(w, BlockFP8) else 1)

    def layer(tree):
        return {k: leaf(k, v) if k in FUSED_LEAVES else v for k, v in tree.items()}
    out = {**weights, "segments": [layer(s) if isinstance(s, dict) else [layer(x) for x in s]
                                   for s in weights["segments"]]}
    if "mtp" in weights:
        out["mtp"] = {**weights["mtp"], "layer": layer(weights["mtp"]["layer"])}
    return out
