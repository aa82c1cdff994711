"""Tokenizer: special tokens, ERNIE's chat template, streaming detokenization of multi-byte text."""

import shutil

import pytest
import sentencepiece as spm

from ernie_jax import LLM, SamplingParams
from ernie_jax.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests.conftest import GOLDEN

TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello jax", "User: hi\nAssistant: hello",
        "Be brief.\nUser: jax?\n", "中文 模型"] * 40
SPECIALS = ["<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:1>"]


def train(folder, vocab_size, byte_fallback):
    # identity normalization and no dummy prefix: newlines and spaces survive and none is invented
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
                                   byte_fallback=byte_fallback, user_defined_symbols=SPECIALS + ["\n"],
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=False,
                                   minloglevel=2)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return train(tmp_path_factory.mktemp("tok"), 400, byte_fallback=True)


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory):
    """Fits the 256-token vocabulary of the golden model."""
    return train(tmp_path_factory.mktemp("small_tok"), 120, byte_fallback=False)


def test_special_tokens_and_chat_template(tokenizer_dir):
    tok = Tokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}, {"role": "user", "content": "jax?"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|begin_of_sentence|>Be brief.\nUser: hello\nAssistant: hi<|end_of_sentence|>User: jax?\n"
                    "Assistant: ")
    ids = tok.encode_chat(messages)
    bos, eos = tok.special_ids["<|begin_of_sentence|>"], tok.special_ids["<|end_of_sentence|>"]
    assert ids[0] == bos and ids.count(eos) == 1 and eos in tok.eos_token_ids
    assert tok.decode(ids) == text.replace("<|begin_of_sentence|>", "").replace("<|end_of_sentence|>", "")
    with pytest.raises(ChatTemplateError, match="messages\\[0\\].role 'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages\\[1\\].content"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": 3}])


def test_streaming_detokenization_never_splits_utf8(tokenizer_dir):
    tok = Tokenizer.from_pretrained(str(tokenizer_dir))
    text = "中文 ERNIE 模型 hello 百度，文心！龘靐齉"  # characters never seen in training are spelled as raw bytes
    ids = tok.encode(text)
    assert any(tok.sp.is_byte(i) for i in ids)  # some characters are spelled as raw UTF-8 bytes
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_token_bytes_join_back_into_text(tokenizer_dir):
    # OpenAI's logprobs `bytes`: a client joining the tokens' bytes gets the text, raw-byte pieces included
    tok = Tokenizer.from_pretrained(str(tokenizer_dir))
    text = "line one\n龘靐齉 two"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids) == text
    newline = tok.token_id("<0x0A>")
    assert tok.token_bytes(newline) == b"\n" and tok.token_text(newline) == "\n"  # an ASCII byte is its character
    lead = tok.token_id("<0xE9>")  # a lone lead byte of a 3-byte character is not text
    assert tok.token_bytes(lead) == b"\xe9" and tok.token_text(lead) == "<0xE9>"


def test_llm_chat_and_text_stream(small_tokenizer_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(GOLDEN / "shared_untied" / "paddle", d)
    for f in small_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    llm = LLM(str(d), dtype="float32", max_model_len=64, max_num_seqs=2)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True))[0]
    assert out.prompt.endswith("Assistant: ") and out.prompt_token_ids[0] == llm.tokenizer.special_ids[
        "<|begin_of_sentence|>"]
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
