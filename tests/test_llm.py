"""The offline LLM API: batching independence, sampling controls, stopping and request validation."""

import functools
import shutil

import pytest
import sentencepiece as spm

from ernie_jax import LLM, RequestError, SamplingParams, SamplingParamsError
from tests.conftest import GOLDEN

PROMPTS = [[1, 17, 33], [5, 6, 7, 8, 9, 10, 11, 12, 13], list(range(100, 117))]  # 3 lengths, 2 prefill buckets


@functools.lru_cache(maxsize=None)
def tiny():
    return LLM("tiny", dtype="float32", seed=0, max_model_len=64, max_num_seqs=4)


def test_batched_equals_alone_greedy():
    llm = tiny()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone
    assert all(len(t) == 10 for t in batched)


def test_per_request_sampling_params_and_seeds():
    llm = tiny()
    a = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=1234, ignore_eos=True)
    b = SamplingParams(temperature=0.7, max_tokens=5, seed=99, ignore_eos=True)
    first = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=[a, b])
    again = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=[a, b])
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert [len(o.outputs[0].token_ids) for o in first] == [8, 5]
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=a)[0].outputs[0].token_ids
    assert alone == first[0].outputs[0].token_ids  # a row's random stream does not depend on the batch
    other = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=4321, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy():
    llm = tiny()
    greedy = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=6))
    for sp in (SamplingParams(temperature=1.5, top_k=1, max_tokens=6, seed=3),
               SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=6, seed=3)):
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]


def test_greedy_pick_is_argmax():
    """The sampler's greedy pick (a max and a min index) is jnp.argmax: the first of tied maxima, the first
    NaN in a row holding one, and 0 in a row of -inf."""
    import jax.numpy as jnp
    import numpy as np

    from ernie_jax.sampling import _argmax
    x = np.random.default_rng(0).normal(size=(6, 300)).astype(np.float32)
    x[1, [7, 40, 299]] = 9.0  # a tie
    x[2, [10, 20]] = np.nan
    x[3] = -np.inf
    x[4, -1] = np.inf
    x[5] = 1.0
    np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(x))), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
    assert np.asarray(_argmax(jnp.asarray(x))).tolist()[1:4] == [7, 10, 0]


def test_stop_token_ids_and_eos():
    llm = tiny()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    toks = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=sp)[0].outputs[0].token_ids
    stop_at = toks[3]
    out = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0].outputs[0]
    first = toks.index(stop_at)
    assert out.token_ids == toks[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # The model's EOS ids stop generation unless ignore_eos is set.
    eos_llm = LLM(tiny().model, max_model_len=64, max_num_seqs=4)
    eos_llm.engine.eos_token_ids = frozenset({stop_at})
    out = eos_llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=SamplingParams(temperature=0, max_tokens=10))
    assert out[0].outputs[0].finish_reason == "stop" and len(out[0].outputs[0].token_ids) == first + 1
    out = eos_llm.generate(prompt_token_ids=[PROMPTS[1]],
                           sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].token_ids == toks


@pytest.mark.parametrize("kwargs, name", [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_k": -5}, "top_k"), ({"n": 0}, "n"),
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(SamplingParamsError, match=f"SamplingParams.{name}="):
        SamplingParams(**kwargs)


def test_bad_requests():
    llm = tiny()  # max_model_len 64
    with pytest.raises(RequestError, match="prompt 1: the prompt is empty"):
        llm.generate(prompt_token_ids=[[1, 2], []])
    with pytest.raises(RequestError, match="max_model_len is 64"):
        llm.generate(prompt_token_ids=[list(range(70))])
    with pytest.raises(RequestError, match="exceed max_model_len"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=62))
    with pytest.raises(RequestError, match="outside"):
        llm.generate(prompt_token_ids=[[1, 5000]])
    with pytest.raises(RequestError, match="tokenizer"):
        llm.generate(["hello"])
    ok = llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(temperature=0, max_tokens=3))
    assert len(ok[0].outputs[0].token_ids) == 3  # still serving after the errors


@pytest.mark.parametrize("max_model_len", [0, -8, 4097])
def test_bad_max_model_len_is_refused(max_model_len):
    # 0 used to mean the default, silently; "tiny" declares 4096 positions (max_position_embeddings)
    with pytest.raises(ValueError, match=rf"max_model_len={max_model_len}: must be from 1 to the model's "
                                         r"max_position_embeddings \(4096\)"):
        LLM("tiny", max_model_len=max_model_len)


def test_text_prompts_with_a_sentencepiece_tokenizer(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(GOLDEN / "shared_untied" / "paddle", d)
    text = ["the quick brown fox jumps over the lazy dog", "ERNIE speaks English and 中文 too",
            "hello world, hello jax"] * 50
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(d / "tokenizer"),
                                   vocab_size=120, model_type="bpe", character_coverage=1.0,
                                   user_defined_symbols=["<|end_of_sentence|>"], minloglevel=2)
    llm = LLM(str(d), dtype="float32", max_model_len=32, max_num_seqs=1)
    assert llm.tokenizer is not None and llm.tokenizer.token_id("<|end_of_sentence|>") in llm.eos_token_ids
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt == "hello world" and out.prompt_token_ids == llm.tokenizer.encode("hello world")
    assert isinstance(out.outputs[0].text, str) and len(out.outputs[0].token_ids) == 5
