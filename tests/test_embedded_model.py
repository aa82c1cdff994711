"""The embedded model (ernie_jax/assets/ernie-4.5-tiny-fp8, trained by python -m ernie_jax.train): FP8 Paddle
loading, chat generation in the corpus's languages, and a Hugging Face tokenizer that agrees with the
SentencePiece one."""

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
import transformers

from ernie_jax.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME
from ernie_jax.train.vocab import GENERATION_CONFIG, hf_tokenizer_json
from ernie_jax.checkpoint import load_pretrained
from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint
from ernie_jax.llm import LLM
from ernie_jax.quant import FP8, BlockFP8
from ernie_jax.sampling import SamplingParams
from ernie_jax.tokenizer import Tokenizer
from tests.conftest import EMBEDDED_ENGINE

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "ERNIE 4.5 是百度的模型, with 300B parameters",
    " leading space",
    "trailing spaces   ",
    "multiple   spaces    inside",
    "line one\nline two\n\nline four\n",
    "tab\tseparated\tvalues",
    "digits 0123456789 and 3.14159",
    "emoji 😀🚀 and symbols ∑ ≈ → é",
    "User: hi\nAssistant: hello",
    "    def forward(self, x):\n        return x @ w",
    "混合专家模型 MoE routes each token to 2 of 8 experts.",
    "龘靐齉",  # never seen in training: spelled as UTF-8 bytes
    "",
]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
                {"role": "user", "content": "用中文回答: 1+1=?"}]


@functools.cache
def sp_tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


@functools.cache
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def _json(name):
    with open(os.path.join(EMBEDDED_MODEL_DIR, name)) as f:
        return json.load(f)


def test_folder_is_small_and_complete():
    files = sorted(os.listdir(EMBEDDED_MODEL_DIR))
    assert files == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert sum(os.path.getsize(os.path.join(EMBEDDED_MODEL_DIR, f)) for f in files) < 25_000_000
    assert os.path.basename(EMBEDDED_MODEL_DIR) == EMBEDDED_MODEL_NAME
    assert _json("generation_config.json") == GENERATION_CONFIG
    # The FP8 release's storage: e4m3fn bits as I8 with F32 block scales, BF16 embeddings/norms/head, F32 router.
    ckpt = SafetensorsCheckpoint(EMBEDDED_MODEL_DIR)
    dtypes = {k: info.dtype for k, info in ckpt.tensors.items()}
    assert dtypes["ernie.layers.1.mlp.experts.15.up_gate_proj.quant_weight"] == "I8"
    assert ckpt.info("ernie.layers.1.mlp.experts.15.up_gate_proj.weight_scale").shape == (2, 2)
    assert dtypes["ernie.layers.1.mlp.shared_experts.up_gate_proj.quant_weight"] == "I8"
    assert dtypes["ernie.mtp_linear_proj.0.quant_weight"] == "I8"
    assert dtypes["ernie.embed_tokens.weight"] == "BF16" and "lm_head.weight" not in dtypes  # tied head
    assert dtypes["ernie.layers.3.mlp.gate.weight"] == dtypes["ernie.layers.3.mlp.moe_statics.e_score_correction_bias"]
    assert dtypes["ernie.layers.3.mlp.gate.weight"] == "F32"
    assert not any(k.endswith("proj.weight") for k in dtypes)  # every linear is quantized


def test_load_pretrained_fp8():
    model = load_pretrained(EMBEDDED_MODEL_DIR)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (256, 6, 4, 2, 64)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.moe_num_experts, cfg.moe_k,
            cfg.moe_num_shared_experts) == (768, 128, 16, 4, 2)
    assert [(s.kind, s.start, s.count) for s in cfg.layer_segments()] == [("dense", 0, 1), ("moe", 1, 5)]
    assert cfg.moe_use_aux_free and cfg.tie_word_embeddings and cfg.has_mtp
    assert (cfg.max_position_embeddings, cfg.rope_theta, cfg.dtype) == (4096, 500000.0, "bfloat16")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, (2,), 0)
    pieces = sp_tokenizer().vocab_size
    assert cfg.vocab_size == -(-pieces // 128) * 128 >= pieces
    qc = cfg.quantization_config
    assert (qc.quantization, qc.dense_quant_type, qc.moe_quant_type, qc.weight_block_size, qc.is_quantized) == (
        "mix_quant", "block_wise_fp8", "block_wise_fp8", (128, 128), True)

    w = model.weights()
    dense, moe = w["segments"]
    for leaf in (dense["qkv"], dense["o"], dense["up_gate"], dense["down"], moe["qkv"], moe["experts_up_gate"],
                 moe["experts_down"], moe["shared_up_gate"], w["mtp"]["proj"], w["mtp"]["layer"]["qkv"],
                 w["mtp"]["layer"]["down"]):
        assert isinstance(leaf, BlockFP8) and leaf.values.dtype == FP8 and leaf.scales.dtype == jnp.float32
    assert moe["experts_up_gate"].shape == (5, 16, 256, 256) and moe["experts_up_gate"].scales.shape == (5, 16, 2, 2)
    assert w["embed"].dtype == jnp.bfloat16 and w["embed"].shape == (cfg.vocab_size, 256) and "lm_head" not in w
    assert moe["router"].dtype == moe["router_bias"].dtype == jnp.float32 and moe["router_bias"].shape == (5, 16)
    assert w["mtp"]["emb_norm"].shape == w["mtp"]["hidden_norm"].shape == (256,)


def test_llm_chat_generates_text():
    # one decode and two prefill programs to compile (a chat prompt is a few tokens); no model: the shipped one
    llm = LLM(**EMBEDDED_ENGINE)
    assert llm.tokenizer.model_file == os.path.join(EMBEDDED_MODEL_DIR, "tokenizer.model")
    tok = llm.tokenizer
    assert tok is not None and {2, tok.token_id("<|end_of_sentence|>")} <= set(llm.eos_token_ids)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.8, 0.8)
    messages = [{"role": "user", "content": "你好"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt == "<|begin_of_sentence|>User: 你好\nAssistant: "
    assert out.prompt_token_ids == tok.encode_chat(messages) and out.prompt_token_ids[0] == tok.token_id(
        "<|begin_of_sentence|>")
    assert not any(tok.sp.is_byte(i) for i in tok.encode("你好"))  # 你 and 好 are pieces, not UTF-8 bytes
    gen = out.outputs[0]
    assert 1 <= len(gen.token_ids) <= 8 and gen.text and gen.text == tok.decode(gen.token_ids)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in gen.text)  # a Chinese prompt gets Chinese characters back
    again = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert again.token_ids == gen.token_ids


def test_hf_tokenizer_encodes_like_sentencepiece():
    ours, hf = sp_tokenizer(), hf_tokenizer()
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text, text
    assert any(ours.sp.is_byte(i) for i in ours.encode("龘靐齉"))
    assert not any(ours.sp.is_byte(i) for i in ours.encode("滚滚长江东逝水，浪花淘尽英雄。"))  # corpus characters
    # Special-token strings inside text: single ids for HF and for encode(allow_special=True).
    text = "<|begin_of_sentence|>User: a<mask:4>b</s>\nAssistant: ok<|end_of_sentence|>"
    assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, allow_special=True)
    assert ours.encode(text) != ours.encode(text, allow_special=True)  # plain encode spells them out


def test_hf_chat_template_and_special_tokens_agree():
    ours, hf = sp_tokenizer(), hf_tokenizer()
    for gen_prompt in (True, False):
        text = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen_prompt)
        assert text == ours.apply_chat_template(CONVERSATION, gen_prompt)
    assert text.startswith("<|begin_of_sentence|>Be brief.\nUser: hello\nAssistant: hi there<|end_of_sentence|>")
    ids = hf.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert list(ids) == ours.encode_chat(CONVERSATION)
    named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
             "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>", "mask_token": "<mask:1>"}
    for attr, piece in named.items():
        assert getattr(hf, attr) == piece and getattr(hf, attr + "_id") == ours.token_id(piece), attr
    assert {t.content: i for i, t in hf.added_tokens_decoder.items()} == ours.special_ids
    assert len(hf) == ours.vocab_size and hf.convert_ids_to_tokens(list(range(ours.vocab_size))) == [
        ours.sp.id_to_piece(i) for i in range(ours.vocab_size)]
    assert hf.encode("hi", add_special_tokens=True) == ours.encode("hi")  # ERNIE adds no BOS/EOS
    cfg = _json("config.json")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)


def test_tokenizer_json_is_the_sentencepiece_model():
    """tokenizer.json is exactly what the build derives from tokenizer.model (no stale copy)."""
    sp = spm.SentencePieceProcessor(model_file=os.path.join(EMBEDDED_MODEL_DIR, "tokenizer.model"))
    with open(os.path.join(EMBEDDED_MODEL_DIR, "tokenizer.json"), encoding="utf-8") as f:
        stored = json.load(f)
    derived = json.loads(hf_tokenizer_json(sp))
    for key in ("added_tokens", "normalizer", "pre_tokenizer", "decoder", "model"):
        assert stored[key] == derived[key], key
    assert len(stored["model"]["vocab"]) == sp.get_piece_size() and len(stored["model"]["merges"]) > 2000
    control = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)]
    assert control == ["<s>", "</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>", "<mask:4>",
                       "<mask:5>", "<mask:6>", "<mask:7>"]
    assert sp.id_to_piece(0) == "<unk>" and sp.is_unknown(0)
    assert np.all([sp.is_byte(i) for i in range(10, 266)])


def test_generate_cli_defaults_to_the_shipped_model(capsys):
    from ernie_jax import generate
    assert generate.main(["--prompt", "你好", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("loaded ernie-4.5-tiny-fp8: 6 layers") and "  text: '" in out
