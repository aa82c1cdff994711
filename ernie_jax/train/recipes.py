"""Named training recipes: a model config (Paddle config.json dialect), a tokenizer size and a TrainConfig.

"embedded" is the model shipped as ernie_jax/assets/ernie-4.5-tiny-fp8: an ERNIE-4.5 MoE shape (a dense
first layer, then MoE layers of 16 routed experts top-4 plus 2 shared experts, GQA 4/2, tied embedding, one
MTP layer), every matrix a whole number of 128x128 FP8 blocks. Its size was chosen from the training
throughput measured on the 2-core CPU (the README's training section has the figures). "ci-tiny" trains
in seconds for the test suite.
"""

from __future__ import annotations

import dataclasses

from ernie_jax.train.step import TrainConfig


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    num_pieces: int  # SentencePiece vocabulary (the embedding rounds it up to a multiple of 128)
    model: dict  # Paddle config.json fields (vocab_size is filled in from the tokenizer)
    train: TrainConfig


def _model(hidden: int, layers: int, heads: int, kv_heads: int, dense_ffn: int, experts: int, k: int,
           expert_ffn: int, shared: int, first_moe: int, max_len: int) -> dict:
    return {
        "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": dense_ffn, "initializer_range": 0.02,
        "max_position_embeddings": max_len, "max_sequence_length": max_len,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "num_hidden_layers": layers, "rms_norm_eps": 1e-05, "use_cache": True, "rope_theta": 500000.0,
        "use_bias": False, "tie_word_embeddings": True, "dtype": "bfloat16",
        "moe_num_experts": experts, "moe_layer_start_index": first_moe, "moe_layer_end_index": layers - 1,
        "moe_layer_interval": 1, "moe_intermediate_size": expert_ffn, "moe_k": k, "moe_gate": "topk",
        "moe_num_shared_experts": shared, "moe_use_aux_free": True, "num_nextn_predict_layers": 1,
        "compression_ratio": 1.0, "fuse_rms_norm": True, "fuse_swiglu": True, "use_flash_attention": True,
        "use_rmsnorm": True,
    }


RECIPES = {
    "embedded": Recipe(
        "embedded", 8192,
        _model(hidden=256, layers=6, heads=4, kv_heads=2, dense_ffn=768, experts=16, k=4, expert_ffn=128,
               shared=2, first_moe=1, max_len=4096),
        TrainConfig(steps=2000, batch_size=12, seq_len=256, learning_rate=3e-3, warmup_steps=100,
                    compute_dtype="float32")),
    "ci-tiny": Recipe(
        "ci-tiny", 384,
        _model(hidden=64, layers=2, heads=4, kv_heads=2, dense_ffn=128, experts=4, k=2, expert_ffn=32,
               shared=0, first_moe=1, max_len=256),
        TrainConfig(steps=8, batch_size=4, seq_len=32, learning_rate=1e-2, warmup_steps=2)),
}


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]
