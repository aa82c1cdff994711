"""Build the embedded model folder (ernie_jax/assets/ernie-4.5-tiny-fp8) deterministically.

    python -m ernie_jax.assets.build_embedded [--dst DIR] [--no-check]

A genuine ERNIE-4.5 MoE checkpoint in the FP8 Paddle release layout, small enough to ship in the package:

1. Tokenizer: a SentencePiece BPE model trained here (byte fallback, digits split, whitespace kept as
   Llama/ERNIE do: identity normalization, no dummy prefix, whitespace-only pieces) on the shared spec
   documents (ERNIE45_SPEC.md etc. in ../shared/docs next to the repository, or --docs), this script and
   the Chinese paragraphs below. Ids 0-2 are <unk> <s> </s>, then ERNIE's special tokens as
   CONTROL pieces (sentencepiece never produces them from text; Tokenizer.encode(allow_special=True) does).
   The same vocabulary is written as a Hugging Face `tokenizer.json` (BPE with byte fallback, merges ordered
   by the SentencePiece scores) that encodes exactly like the SentencePiece model, with ERNIE's
   tokenizer_config.json (special tokens, chat template) and `tokenizer_class: PreTrainedTokenizerFast`, so
   `transformers.AutoTokenizer` loads it without remote code in transformers 4.x and 5.x.
2. config.json in the Paddle dialect (ERNIE45_SPEC.md 1.2) for a small MoE shaped like the 300B model:
   hidden 256, 4 layers (layer 0 dense, 1-3 MoE), 4 query / 2 KV heads of 64, 8 experts top-2, no shared
   experts, correction bias, untied LM head, one MTP layer; vocab_size = pieces rounded up to 128.
3. Random BF16 Paddle weights (named by checkpoint.layouts.PADDLE, two shards and an index), converted with
   converters.quantize_fp8 to the FP8 release layout (128x128 blocks); the BF16 copy is a temp folder.

The output depends only on this file, the documents and the library versions (sentencepiece, tokenizers, jax).
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np

from ernie_jax.assets import EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DOCS = os.path.join(os.path.dirname(REPO), "shared", "docs")

NUM_PIECES = 3000  # SentencePiece vocabulary; the embedding has 3072 rows (a multiple of 128), like the
# real model, whose 103424 rows exceed its piece count. ~3000 keeps the folder under 8 MB.
SEED = 0
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CLS, SEP, MASK = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>"
ERNIE_SPECIALS = [CLS, SEP, MASK, "<mask:4>", "<mask:5>", "<mask:6>", "<mask:7>"]

# Written for this model (not copied): enough Chinese that its characters are real pieces.
CHINESE = """\
文心大模型是百度研发的知识增强大语言模型。它能够理解和生成中文与英文文本，回答问题，撰写文章，翻译语言，编写代码。
混合专家模型把每一层的前馈网络拆分成许多专家，每个词元只激活其中少数几个专家，因此参数总量很大，而每次计算的开销却不高。
你好！很高兴认识你。今天天气怎么样？北京今天晴转多云，最高气温二十八度，最低气温十九度，空气质量良好，适合外出散步。
请问你需要什么帮助？我可以帮你查询资料、整理笔记、解释概念，或者和你一起讨论问题。
在推理服务中，用户的请求先经过分词器变成词元序列，然后模型逐个生成新的词元。预填充阶段一次处理整段提示词，解码阶段每一步只处理一个新词元。
键值缓存保存了注意力层的中间结果，使得每一步解码不必重新计算之前的内容。连续批处理让新的请求可以随时加入正在运行的批次。
低精度量化可以显著减少显存占用。八位浮点格式把权重按一百二十八乘一百二十八的块分组，每一块保存一个缩放因子。
反量化时，把每个八位数值乘以所在块的缩放因子，就得到近似的原始权重。矩阵乘法在张量核心上完成，累加使用三十二位浮点数。
春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。床前明月光，疑是地上霜。举头望明月，低头思故乡。
学而时习之，不亦说乎？有朋自远方来，不亦乐乎？三人行，必有我师焉。知之为知之，不知为不知，是知也。
2025年7月1日，我们在上海举办了一场技术交流会，来自二十多个城市的工程师参加了讨论。会议从上午九点开始，下午五点结束。
编程的第一课通常是在屏幕上打印“你好，世界”。谢谢你的耐心。如果还有其他问题，欢迎随时提问。祝你学习进步，工作顺利，身体健康，万事如意！
用户：请用一句话介绍你自己。助手：我是一个由文心模型驱动的人工智能助手，很乐意为你服务。
"""

# ERNIE's chat template (ERNIE45_SPEC.md section 6), rendered exactly like tokenizer.Tokenizer.apply_chat_template;
# content is a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{{- '<|begin_of_sentence|>' -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] != 'text' -%}"
    "{{- raise_exception('only text content parts are supported') -}}{%- endif -%}{%- endfor -%}"
    "{%- set content = message['content'] | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- content + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + content + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + content + '<|end_of_sentence|>' -}}"
    "{%- else -%}{{- raise_exception('role ' + message['role'] + ' is not system, user or assistant') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)


# ---- tokenizer -------------------------------------------------------------------------------------------
def corpus(docs: str = SHARED_DOCS) -> list[str]:
    """Lines of the shared spec documents (docs/*.md), of this script, and the Chinese paragraphs (x4).
    Only files that do not move with day-to-day work, so the tokenizer (and the folder) can be regenerated
    byte for byte; the documents are required for the same reason."""
    docs_files = sorted(glob.glob(os.path.join(docs, "*.md")))
    if not docs_files:
        raise SystemExit(f"no *.md documents in {docs!r} (the tokenizer corpus); pass --docs DIR")
    lines = []
    for file in docs_files + [os.path.abspath(__file__)]:
        with open(file, encoding="utf-8") as f:
            lines += [line for line in f.read().splitlines() if line.strip()]
    return lines + CHINESE.splitlines() * 4


def train_sentencepiece(lines: list[str]) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()  # model_writer (not model_prefix): no output path is recorded in the model
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=NUM_PIECES,
        character_coverage=1.0, byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
        control_symbols=ERNIE_SPECIALS, num_threads=1, minloglevel=2)
    return buf.getvalue()


def hf_tokenizer_json(sp) -> str:
    """The SentencePiece BPE model as a `tokenizers` BPE: same vocabulary and ids, byte fallback, a merge for
    every split of a normal piece into two normal pieces, ranked by the piece's score (SentencePiece merges the
    pair whose result scores highest). Spaces become U+2581 with no dummy prefix; control pieces are special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    normal = {sp.id_to_piece(i): i for i in range(n) if not (i in special or sp.is_byte(i) or sp.is_unused(i))}
    ranked = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-sp.get_score(i), i, normal[left], normal[right], left, right))
    merges = [(r[4], r[5]) for r in sorted(ranked)]
    assert not any(" " in p for p in vocab), "a piece holds an ASCII space: the merges format below breaks"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    # Written in the format every tokenizers release reads (0.15 on, i.e. transformers 4.38+): merges as "left
    # right" strings (pieces never hold an ASCII space), and no `ignore_merges` key (added in 0.19, default off).
    spec = json.loads(tok.to_str())
    spec["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    spec["model"].pop("ignore_merges", None)
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


def tokenizer_config(sp, max_length: int) -> dict:
    added = {str(i): {"content": sp.id_to_piece(i), "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": UNK,
        "unk_token": UNK,
        "cls_token": CLS,
        "sep_token": SEP,
        "mask_token": MASK,
        "sys_start_token": "<mask:4>",
        "sys_end_token": "<mask:5>",
        "header_start_token": "<mask:6>",
        "header_end_token": "<mask:7>",
        "additional_special_tokens": ERNIE_SPECIALS[3:],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "spaces_between_special_tokens": False,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": UNK, "unk_token": UNK, "cls_token": CLS,
            "sep_token": SEP, "mask_token": MASK, "additional_special_tokens": ERNIE_SPECIALS[3:]}


# ---- model -----------------------------------------------------------------------------------------------
def model_config(vocab_size: int) -> dict:
    """Paddle-dialect config.json (spec 1.2); quantization_config is added by the FP8 conversion."""
    return {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 256,
        "intermediate_size": 512,
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "max_sequence_length": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "rms_norm_eps": 1e-05,
        "use_cache": True,
        "vocab_size": vocab_size,
        "rope_theta": 500000.0,
        "use_bias": False,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "moe_num_experts": 8,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 3,
        "moe_layer_interval": 1,
        "moe_intermediate_size": 128,
        "moe_capacity": [8, 8, 8],
        "moe_gate": "topk",
        "moe_k": 2,
        "moe_num_shared_experts": 0,
        "moe_use_aux_free": True,
        "moe_aux_loss_lambda": 1e-05,
        "moe_z_loss_lambda": 0.0,
        "moe_orthogonal_loss_lambda": 0.0,
        "moe_group_orthogonal_loss": True,
        "global_aux_loss": False,
        "num_nextn_predict_layers": 1,
        "add_tail_layers": False,
        "compression_ratio": 1.0,
        "fuse_gate_detach_matmul": True,
        "fuse_linear": False,
        "fuse_ln": False,
        "fuse_rms_norm": True,
        "fuse_rope": False,
        "fuse_swiglu": True,
        "use_fast_ln": False,
        "use_flash_attention": True,
        "use_rmsnorm": True,
        "model_name": EMBEDDED_MODEL_NAME,
        "paddlenlp_version": "3.0.0",
    }


GENERATION_CONFIG = {  # ERNIE45_SPEC.md section 6
    "do_sample": True, "top_p": 0.8, "temperature": 0.8, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
}
QUANTIZATION_CONFIG = {"weight_block_size": [128, 128]}  # added to quantize_fp8's dense/moe/mix_quant keys


def random_weights(cfg, sp) -> dict:
    """weights.init_weights with linears at 1/sqrt(fan_in) and embeddings at std 0.5 (so every layer moves the
    residual stream and greedy text depends on the context, not only on the last token), and an LM head at
    std 2/sqrt(H) (logits of std ~2) that favours ordinary pieces: the columns of byte, control (except the two
    end-of-turn tokens) and padding ids are scaled by 0.05, as a trained model would rarely emit them."""
    import jax
    import jax.numpy as jnp

    from ernie_jax.model.weights import init_weights

    w = jax.tree.map(np.asarray, init_weights(cfg, seed=SEED, dtype=jnp.float32, scale=1.0))
    w["embed"] = w["embed"] * 0.5
    quiet = np.ones(cfg.vocab_size, np.float32)
    for i in range(cfg.vocab_size):
        if i >= sp.get_piece_size() or sp.is_byte(i) or sp.is_unknown(i) or (
                sp.is_control(i) and sp.id_to_piece(i) not in (EOS, SEP)):
            quiet[i] = 0.05
    w["lm_head"] = w["lm_head"] * 2.0 * quiet
    return w


def paddle_tensors(cfg, weights: dict) -> dict[str, np.ndarray]:
    """The weights pytree under the Paddle release names (checkpoint.layouts.PADDLE), [in, out] linears,
    one tensor per expert, the correction bias as [1, E]; router and bias F32, everything else BF16."""
    from ernie_jax.checkpoint.layouts import PADDLE, Src
    from ernie_jax.model.weights import F32_LEAVES

    out: dict[str, np.ndarray] = {}
    leaf_of = {src: leaf for table in (PADDLE.top, PADDLE.layer, PADDLE.mtp) for leaf, src in table.items()}

    def put(prefix: str, src, arr: np.ndarray):
        assert isinstance(src, Src) and not src.transpose, src
        arr = np.asarray(arr, np.float32 if leaf_of[src] in F32_LEAVES else ml_dtypes.bfloat16)
        if "{e}" in src.key:
            for e in range(arr.shape[0]):
                out[prefix + src.key.format(e=e)] = arr[e]
        else:
            out[prefix + src.key] = arr.reshape(1, -1) if src.squeeze else arr

    for leaf in ("embed", "final_norm", "lm_head"):
        if leaf in weights:
            put("", PADDLE.top[leaf], weights[leaf])
    for seg, seg_w in zip(cfg.layer_segments(), weights["segments"]):
        for j in range(seg.count):
            for leaf, arr in seg_w.items():
                put(PADDLE.layer_prefix.format(i=seg.start + j), PADDLE.layer[leaf], arr[j])
    if "mtp" in weights:
        for name in ("emb_norm", "hidden_norm", "proj"):
            put("", PADDLE.mtp[name], weights["mtp"][name])
        for leaf, arr in weights["mtp"]["layer"].items():
            put(PADDLE.mtp_layer_prefix, PADDLE.layer[leaf], arr)
    return out


def write_bf16_checkpoint(folder: str, cfg, tensors: dict[str, np.ndarray]) -> None:
    """Two shards and an index, like the release: embedding and the first half of the layers, then the rest."""
    from ernie_jax.checkpoint.safetensors_io import save_file

    half = cfg.num_hidden_layers // 2
    first = {k for k in tensors if k.startswith("ernie.embed_tokens") or any(
        k.startswith(f"ernie.layers.{i}.") for i in range(half))}
    shards = [sorted(first), sorted(set(tensors) - first)]
    weight_map, total = {}, 0
    for n, names in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        for k in names:
            weight_map[k] = file
            total += tensors[k].nbytes
        save_file({k: tensors[k] for k in names}, os.path.join(folder, file))
    _dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
          os.path.join(folder, "model.safetensors.index.json"))


def _dump(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---- build -----------------------------------------------------------------------------------------------
def build(dst: str = EMBEDDED_MODEL_DIR, docs: str = SHARED_DOCS) -> str:
    import sentencepiece as spm

    from converters import quantize_fp8
    from ernie_jax.config import ErnieConfig

    model_proto = train_sentencepiece(corpus(docs))
    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    vocab_size = -(-sp.get_piece_size() // 128) * 128
    config = model_config(vocab_size)
    cfg = ErnieConfig.from_dict(config)
    with tempfile.TemporaryDirectory(prefix="ernie_embedded_") as tmp:
        src = os.path.join(tmp, "bf16-paddle")
        os.makedirs(src)
        with open(os.path.join(src, "tokenizer.model"), "wb") as f:
            f.write(model_proto)
        with open(os.path.join(src, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(hf_tokenizer_json(sp) + "\n")
        _dump(tokenizer_config(sp, config["max_position_embeddings"]), os.path.join(src, "tokenizer_config.json"))
        _dump(special_tokens_map(), os.path.join(src, "special_tokens_map.json"))
        _dump(GENERATION_CONFIG, os.path.join(src, "generation_config.json"))
        _dump(config, os.path.join(src, "config.json"))
        write_bf16_checkpoint(src, cfg, paddle_tensors(cfg, random_weights(cfg, sp)))
        fp8 = os.path.join(tmp, "fp8-paddle")
        quantize_fp8.convert(src, fp8, quiet=True)
        with open(os.path.join(fp8, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"].update(QUANTIZATION_CONFIG)
        _dump(config, os.path.join(fp8, "config.json"))
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(fp8, dst)
    return dst


def check(path: str) -> None:
    """Print what the model says to a few prompts (greedy), to eyeball that the text is not degenerate."""
    from ernie_jax.llm import LLM
    from ernie_jax.sampling import SamplingParams

    llm = LLM(path, max_model_len=256, max_num_seqs=1, prefill_chunk=64, compilation_cache_dir=None)
    sp = SamplingParams(temperature=0, max_tokens=24)
    for prompt in ("你好", "What is a mixture of experts?", "1 2 3 4", "Tell me a story about the sea."):
        out = llm.chat([{"role": "user", "content": prompt}], sp)[0].outputs[0]
        print(f"{prompt!r} -> {out.text!r} ({len(set(out.token_ids))} distinct of {len(out.token_ids)}, "
              f"{out.finish_reason})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.assets.build_embedded", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dst", default=EMBEDDED_MODEL_DIR, help="output folder (default: the packaged one)")
    ap.add_argument("--docs", default=SHARED_DOCS, help="folder of the spec documents for the tokenizer corpus")
    ap.add_argument("--no-check", action="store_true", help="skip the sample generations at the end")
    args = ap.parse_args(argv)
    dst = build(args.dst, args.docs)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    print(f"wrote {dst}: {size / 1e6:.2f} MB")
    if not args.no_check:
        check(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
