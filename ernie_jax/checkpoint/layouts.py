"""Declarative tables: which checkpoint tensors make each leaf of the weights pytree, per layout.

A recipe says where a leaf comes from: `Src` (one stored tensor, its shape in symbolic dims, whether to
swap its last two axes), `Cat` (several sources joined along the output axis, e.g. HF q/k/v -> [Q|K|V]),
or `OneOf` (alternative encodings, the first whose tensors exist wins). A `{e}` in a key means one tensor
per expert, stacked into a leading E axis. Keys of `layer` are relative to the layer prefix; the MTP block
reuses the dense-layer rows under its own prefix.

Layouts (docs/model.md §3): the official Paddle release (`ernie.` prefix, [in,out] linears,
fused [Q|K|V] and [gate|up]) and HF transformers (`model.` prefix, split q/k/v and gate/up, [out,in]).
PaddleFormers 1.x native saves are detected and refused (see `detect_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Union

from ernie_jax.config import ErnieConfig


@dataclasses.dataclass(frozen=True)
class Src:
    key: str
    shape: tuple[str, ...]  # symbolic stored shape, resolved by `dims`
    transpose: bool = False  # swap the last two axes ([out,in] -> [in,out])
    squeeze: bool = False  # drop a leading axis of size 1 ([1,E] -> [E])


@dataclasses.dataclass(frozen=True)
class Cat:
    parts: tuple[Src, ...]  # joined along the last axis after their transposes


@dataclasses.dataclass(frozen=True)
class OneOf:
    options: tuple["Recipe", ...]


Recipe = Union[Src, Cat, OneOf]


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    top: dict[str, Recipe]
    layer: dict[str, Recipe]
    mtp: dict[str, Recipe]
    layer_prefix: str  # with {i}
    mtp_layer_prefix: str
    kv_scales: dict[str, Recipe] = dataclasses.field(default_factory=dict)  # optional static FP8-KV scales


def dims(cfg: ErnieConfig) -> dict[str, int]:
    """Symbolic dimension names used in the tables, with the config fields they come from."""
    return {
        "1": 1, "H": cfg.hidden_size, "H2": 2 * cfg.hidden_size, "V": cfg.vocab_size,
        "Q": cfg.q_size, "KV": cfg.kv_size, "QKV": cfg.q_size + 2 * cfg.kv_size,
        "F": cfg.intermediate_size, "F2": 2 * cfg.intermediate_size,
        "Fm": cfg.moe_intermediate_size, "Fm2": 2 * cfg.moe_intermediate_size,
        "Fs": cfg.shared_intermediate_size, "Fs2": 2 * cfg.shared_intermediate_size,
        "E": cfg.moe_num_experts, "K": cfg.num_key_value_heads,
    }


DIM_MEANING = {
    "H": "hidden_size", "H2": "2*hidden_size", "V": "vocab_size", "Q": "num_attention_heads*head_dim",
    "KV": "num_key_value_heads*head_dim", "QKV": "(num_attention_heads+2*num_key_value_heads)*head_dim",
    "F": "intermediate_size", "F2": "2*intermediate_size", "Fm": "moe_intermediate_size",
    "Fm2": "2*moe_intermediate_size", "Fs": "moe_num_shared_experts*moe_intermediate_size",
    "Fs2": "2*moe_num_shared_experts*moe_intermediate_size", "E": "moe_num_experts", "1": "1",
    "K": "num_key_value_heads",
}

PADDLE = Layout(
    name="paddle",
    top={
        "embed": Src("ernie.embed_tokens.weight", ("V", "H")),
        "final_norm": Src("ernie.norm.weight", ("H",)),
        "lm_head": Src("lm_head.weight", ("H", "V")),
    },
    layer={
        "input_norm": Src("input_layernorm.weight", ("H",)),
        "post_norm": Src("post_attention_layernorm.weight", ("H",)),
        "qkv": Src("self_attn.qkv_proj.weight", ("H", "QKV")),
        "o": Src("self_attn.o_proj.weight", ("Q", "H")),
        "up_gate": Src("mlp.up_gate_proj.weight", ("H", "F2")),
        "down": Src("mlp.down_proj.weight", ("F", "H")),
        "router": Src("mlp.gate.weight", ("H", "E")),
        "router_bias": Src("mlp.moe_statics.e_score_correction_bias", ("1", "E"), squeeze=True),
        "experts_up_gate": Src("mlp.experts.{e}.up_gate_proj.weight", ("H", "Fm2")),
        "experts_down": Src("mlp.experts.{e}.down_proj.weight", ("Fm", "H")),
        "shared_up_gate": Src("mlp.shared_experts.up_gate_proj.weight", ("H", "Fs2")),
        "shared_down": Src("mlp.shared_experts.down_proj.weight", ("Fs", "H")),
    },
    mtp={
        "emb_norm": Src("ernie.mtp_emb_norm.0.weight", ("H",)),
        "hidden_norm": Src("ernie.mtp_hidden_norm.0.weight", ("H",)),
        "proj": Src("ernie.mtp_linear_proj.0.weight", ("H2", "H")),
    },
    layer_prefix="ernie.layers.{i}.",
    mtp_layer_prefix="ernie.mtp_block.0.",
    # FastDeploy's static FP8 KV cache: per-KV-head absmax of K and V (after RoPE).
    kv_scales={"k_scale": Src("self_attn.cachek_matmul.activation_scale", ("K",)),
               "v_scale": Src("self_attn.cachev_matmul.activation_scale", ("K",))},
)


def _t(key: str, *shape: str) -> Src:
    return Src(key, tuple(shape), transpose=True)


HF = Layout(
    name="hf",
    top={
        "embed": Src("model.embed_tokens.weight", ("V", "H")),
        "final_norm": Src("model.norm.weight", ("H",)),
        "lm_head": _t("lm_head.weight", "V", "H"),
    },
    layer={
        "input_norm": Src("input_layernorm.weight", ("H",)),
        "post_norm": Src("post_attention_layernorm.weight", ("H",)),
        "qkv": Cat((_t("self_attn.q_proj.weight", "Q", "H"), _t("self_attn.k_proj.weight", "KV", "H"),
                    _t("self_attn.v_proj.weight", "KV", "H"))),
        "o": _t("self_attn.o_proj.weight", "H", "Q"),
        "up_gate": Cat((_t("mlp.gate_proj.weight", "F", "H"), _t("mlp.up_proj.weight", "F", "H"))),
        "down": _t("mlp.down_proj.weight", "H", "F"),
        "router": _t("mlp.gate.weight", "E", "H"),
        "router_bias": OneOf((Src("mlp.moe_statics.e_score_correction_bias", ("1", "E"), squeeze=True),
                              Src("mlp.gate.moe_statics.e_score_correction_bias", ("1", "E"), squeeze=True))),
        # Files on the Hub hold one tensor per expert; transformers 5 keeps them fused in memory.
        "experts_up_gate": OneOf((
            Cat((_t("mlp.experts.{e}.gate_proj.weight", "Fm", "H"), _t("mlp.experts.{e}.up_proj.weight", "Fm", "H"))),
            _t("mlp.experts.gate_up_proj", "E", "Fm2", "H"),
        )),
        "experts_down": OneOf((
            _t("mlp.experts.{e}.down_proj.weight", "H", "Fm"),
            _t("mlp.experts.down_proj", "E", "H", "Fm"),
        )),
        "shared_up_gate": Cat((_t("mlp.shared_experts.gate_proj.weight", "Fs", "H"),
                               _t("mlp.shared_experts.up_proj.weight", "Fs", "H"))),
        "shared_down": _t("mlp.shared_experts.down_proj.weight", "H", "Fs"),
    },
    mtp={
        "emb_norm": Src("model.mtp_emb_norm.0.weight", ("H",)),
        "hidden_norm": Src("model.mtp_hidden_norm.0.weight", ("H",)),
        "proj": _t("model.mtp_linear_proj.0.weight", "H", "H2"),
    },
    layer_prefix="model.layers.{i}.",
    mtp_layer_prefix="model.mtp_block.0.",
)

LAYOUTS = {"paddle": PADDLE, "hf": HF}


def detect_layout(keys: set[str], source: str) -> Layout:
    """Pick the layout from the tensor names alone; refuse anything ambiguous rather than guess."""
    from ernie_jax.checkpoint.safetensors_io import CheckpointError

    if any(k.startswith("ernie.") for k in keys):
        return PADDLE
    if any(k.startswith("model.layers.") and k.endswith("self_attn.qkv_proj.weight") for k in keys):
        raise CheckpointError(
            f"{source}: this looks like a PaddleFormers 1.x native save ('model.' prefix with a fused "
            "'qkv_proj' grouped per KV head and lm_head stored [V,H]). Its o_proj/down_proj orientation "
            "depends on the save path and is not recorded in the files, so it cannot be loaded without "
            "guessing. Re-export it with save_to_hf=True (HF layout) or use the official '-Paddle' layout.")
    if "model.embed_tokens.weight" in keys:
        quantized = sorted(k for k in keys if k.endswith(".quant_weight"))
        if quantized:
            raise CheckpointError(f"{source}: block-FP8 tensors (e.g. {quantized[0]!r}) in the HF layout; FP8 "
                                  "weights are read only in the Paddle release layout")
        return HF
    example = sorted(keys)[:3]
    raise CheckpointError(f"{source}: unrecognised tensor names (e.g. {example}); expected the Paddle release "
                          "layout ('ernie.' prefix) or the HF transformers layout ('model.' prefix)")
