"""The tokenizer files of an ERNIE-4.5 model folder, trained here: SentencePiece BPE plus its HF twin.

`train_sentencepiece(lines)` trains a BPE model the way Llama and ERNIE tokenize (byte fallback, digits split,
whitespace kept: identity normalization, no dummy prefix, whitespace-only pieces). Ids 0-2 are
<unk> <s> </s>, as in the real release; ERNIE's other special tokens (whose release ids, 100273 and up, do
not fit a small vocabulary) follow as CONTROL pieces, which sentencepiece never produces from text
(Tokenizer.encode(allow_special=True) does). `write_tokenizer_files` writes tokenizer.model, the same
vocabulary as a Hugging Face `tokenizer.json` (BPE with byte fallback, merges ordered by the SentencePiece
scores) that encodes exactly like the SentencePiece model, ERNIE's tokenizer_config.json (special tokens,
chat template, `tokenizer_class: PreTrainedTokenizerFast`, so `transformers.AutoTokenizer` loads it without
remote code in transformers 4.x and 5.x), special_tokens_map.json and generation_config.json.
"""

from __future__ import annotations

import io
import json
import os
import re

NUM_PIECES = 8192
# Characters covered by pieces of their own; the rarest Chinese characters (0.05 % of characters) are
# spelled in bytes, which keeps about 8k pieces enough for English and simplified Chinese together.
CHARACTER_COVERAGE = 0.9995
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CLS, SEP, MASK = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>"
ERNIE_SPECIALS = [CLS, SEP, MASK, "<mask:4>", "<mask:5>", "<mask:6>", "<mask:7>"]

# ERNIE's chat template (docs/model.md §6), rendered exactly like tokenizer.Tokenizer.apply_chat_template;
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


class VocabError(ValueError):
    """Text that a tokenizer of the asked size cannot be trained on; the message says what it would need."""


def train_sentencepiece(lines: list[str], num_pieces: int = NUM_PIECES) -> bytes:
    """A SentencePiece BPE model (serialized) trained on `lines`, deterministic for the same lines."""
    import sentencepiece as spm

    buf = io.BytesIO()  # model_writer (not model_prefix): no output path is recorded in the model
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=num_pieces,
            character_coverage=CHARACTER_COVERAGE, max_sentence_length=1 << 16, byte_fallback=True,
            split_digits=True, normalization_rule_name="identity",
            add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
            control_symbols=ERNIE_SPECIALS, num_threads=1, minloglevel=2)
    except RuntimeError as e:
        need = re.search(r"required_chars\. (\d+) vs (\d+)", str(e))
        if need is None:
            raise
        raise VocabError(f"{num_pieces} pieces cannot hold this text's {need.group(2)} required pieces (the "
                         f"characters covering {CHARACTER_COVERAGE:.2%} of it, plus the special and byte "
                         "pieces)") from None
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


GENERATION_CONFIG = {  # docs/model.md §6
    "do_sample": True, "top_p": 0.8, "temperature": 0.8, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
}


def _dump(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_tokenizer_files(folder: str, model_proto: bytes, max_length: int) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(model_proto)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(hf_tokenizer_json(sp) + "\n")
    _dump(tokenizer_config(sp, max_length), os.path.join(folder, "tokenizer_config.json"))
    _dump(special_tokens_map(), os.path.join(folder, "special_tokens_map.json"))
    _dump(GENERATION_CONFIG, os.path.join(folder, "generation_config.json"))
