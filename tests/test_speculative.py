"""MTP speculative decoding: lossless greedy, the exact sampled distribution, config errors, metrics."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import LLM, SamplingParams, load_pretrained
from ernie_jax.assets import EMBEDDED_MODEL_DIR
from ernie_jax.engine.speculative import SpeculativeConfig, SpeculativeConfigError
from ernie_jax.sampling import filtered_logits, speculative_verify
from tests.conftest import EMBEDDED_ENGINE, GOLDEN


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@functools.lru_cache(maxsize=None)
def golden(name="shared_untied"):
    return load_pretrained(GOLDEN / name / "paddle", dtype=jnp.float32)


def chat_prompts(llm) -> list[list[int]]:
    msgs = ["Tell me about the sea.", "你好", "What do you think of Mr. Darcy?", "说说曹操。"]
    return [llm.tokenizer.encode_chat([{"role": "user", "content": m}]) for m in msgs]


def greedy(llm, prompts, n=40):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]


def test_config_errors_name_the_field():
    assert SpeculativeConfig.parse('{"method": "ernie_mtp", "num_speculative_tokens": 3}') == SpeculativeConfig("ernie_mtp", 3)
    assert SpeculativeConfig.parse(None) is None
    for bad, field in [('{"method": "mtp"', "not valid JSON"), ('{"method": "ngram"}', "method='ngram'"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
                       ({"num_speculative_tokens": 5}, "num_speculative_tokens=5"),
                       ({"num_speculative_tokens": True}, "num_speculative_tokens=True"),
                       ({"num_speculative_token": 1}, "unknown field"), ("[1]", "JSON object")]:
        with pytest.raises(SpeculativeConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="the MTP weights are read from the served checkpoint"):
        LLM(str(EMBEDDED_MODEL_DIR), max_model_len=64, speculative_config={"model": "/elsewhere/mtp"})
    with pytest.raises(ValueError, match="needs the model's MTP block"):
        LLM(golden("noshared_tied"), max_model_len=64, max_num_seqs=2, speculative_config=spec(1))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 0.9)])
def test_sampled_verification_keeps_the_target_distribution(top_k, top_p):
    """Rows of one small-vocabulary case, each with its own seed: the first emitted token follows p_0 and,
    where the first draft was accepted, the second follows p_1 (chi-square, p > 0.01); the draft at
    position 0 is accepted at the rate p_0(draft)."""
    from scipy.stats import chisquare
    N, V = 20000, 6
    rng = np.random.default_rng(0)
    logits = jnp.asarray(np.broadcast_to(rng.standard_normal((1, 3, V)) * 1.5, (N, 3, V)), jnp.float32)
    t = jnp.full(N, 0.8)
    p = jax.nn.softmax(filtered_logits(logits[0], jnp.full(3, 0.8), jnp.full(3, top_p), jnp.full(3, top_k, jnp.int32)))
    p = np.asarray(p, np.float64)
    d1, d2 = int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))  # a draft the target accepts sometimes, not always
    drafts = jnp.asarray(np.broadcast_to([[d1, d2]], (N, 2)), jnp.int32)
    tokens, accepted = speculative_verify(logits, drafts, t, jnp.full(N, top_p), jnp.full(N, top_k, jnp.int32),
                                          jnp.arange(N, dtype=jnp.uint32), jnp.zeros(N, jnp.int32),
                                          jnp.full(N, 2, jnp.int32))
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    for position, rows in ((0, np.ones(N, bool)), (1, accepted >= 1)):
        support = p[position] > 0
        counts = np.bincount(tokens[rows, position], minlength=V)
        assert counts[~support].sum() == 0  # nothing outside top-k / top-p
        expected = p[position][support] / p[position][support].sum() * rows.sum()
        assert chisquare(counts[support], expected).pvalue > 0.01, (position, counts, expected)
    assert abs((accepted >= 1).mean() - p[0, d1]) < 4 * np.sqrt(p[0, d1] * (1 - p[0, d1]) / N)
    assert np.all(tokens[accepted >= 1, 0] == d1)


def test_greedy_verification_and_max_accept():
    logits = jnp.asarray(np.eye(5)[[[2, 3, 4], [2, 3, 4], [2, 3, 4]]] * 5, jnp.float32)  # argmax 2, then 3, 4
    drafts = jnp.asarray([[2, 3], [2, 0], [2, 3]], jnp.int32)
    z = jnp.zeros(3)
    tokens, accepted = speculative_verify(logits, drafts, z, z + 1, jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.uint32),
                                          jnp.zeros(3, jnp.int32), jnp.asarray([2, 2, 0], jnp.int32))
    assert np.asarray(accepted).tolist() == [2, 1, 0]
    assert np.asarray(tokens).tolist() == [[2, 3, 4], [2, 3, 4], [2, 3, 4]]  # greedy rows emit the argmax path


# The shared engine shape (tests/conftest.py): the plain engine's programs come from the XLA cache, and the
# MTP engine compiles 3 (the prompts here are 10 to 40 tokens; two sequences decode side by side)
EMBEDDED = EMBEDDED_ENGINE


@functools.lru_cache(maxsize=None)
def embedded(k: int = 0) -> LLM:
    return LLM(EMBEDDED_MODEL_DIR, **EMBEDDED, speculative_config=spec(k) if k else None)


def test_greedy_with_mtp_equals_greedy_without_on_the_trained_model():
    """k = 2 on the embedded (trained) model: token for token the plain greedy output, drafts accepted at both
    positions, and the counters in the engine's report and the server's metrics; a stop token inside an
    accepted run ends the request there; seeded sampling is reproducible."""
    base, llm = embedded(), embedded(2)
    prompts = chat_prompts(base)
    want = greedy(base, prompts, n=24)  # unoptimised test programs: each token counts in the suite's time
    assert greedy(llm, prompts, n=24) == want
    stats = llm.engine.spec_stats.report()
    assert stats["accepted_per_position"][0] > 0 and stats["accepted_per_position"][1] > 0, stats
    assert stats["mean_accepted_length"] > 1.3, stats
    stop = want[0][5]  # a token the first reply emits: the run stops at its first occurrence
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    out = llm.generate(prompt_token_ids=prompts[:1], sampling_params=sp)[0].outputs[0]
    assert out.token_ids == want[0][:want[0].index(stop) + 1] and out.finish_reason == "stop"
    # a request asking for logprobs takes one token per step (host sampler) beside speculating ones
    mixed = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=lp) for lp in (None, 0, 2, None)]
    plain_out, spec_out = (llm_.generate(prompt_token_ids=prompts, sampling_params=mixed) for llm_ in (base, llm))
    for a, b in zip(plain_out, spec_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.outputs[0].logprobs is not None:
            np.testing.assert_allclose([e["logprob"] for e in b.outputs[0].logprobs],
                                       [e["logprob"] for e in a.outputs[0].logprobs], atol=1e-5)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7)
    runs = [llm.generate(prompt_token_ids=prompts, sampling_params=sampled) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    from ernie_jax.serve.metrics import ServerMetrics
    text = ServerMetrics(llm.engine.stats, "m").render().decode()
    assert 'ernie_jax:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}' in text
    assert "ernie_jax:spec_decode_num_drafts_total" in text and "ernie_jax:spec_decode_num_draft_tokens_total" in text
    for pool in llm.engine.pools.values():
        pool.check()
        assert pool.free == pool.capacity


GOLDEN_CASES = [(1, "single", "auto"), (2, "single", "auto"), (3, "single", "auto"), (2, "colocated8", "fp8"),
                (3, "pd", "auto"), (1, "pd", "fp8")]


@pytest.mark.parametrize("k,mode,kv", GOLDEN_CASES)
def test_greedy_with_mtp_equals_greedy_without_on_golden(k, mode, kv):
    """The golden MTP model (random weights: drafts are rarely accepted, so this checks the rejection path and
    the MTP cache bookkeeping), prompts of several lengths, on one device, colocated on 8, and PD 4 + 4."""
    prompts = [[1, 5, 9, 33, 7], [1, 200, 3], [1] + list(range(40, 70))]
    kw = dict(max_model_len=64, max_num_seqs=4, kv_cache_dtype=kv,
              **{"single": {}, "colocated8": dict(mesh=8, disaggregate=False),
                 "pd": dict(mesh=8, prefill_devices=4)}[mode])
    want = greedy(LLM(golden(), **kw), prompts, 20)
    assert greedy(LLM(golden(), **kw, speculative_config=spec(k)), prompts, 20) == want


def test_preemption_and_prefix_caching_stay_exact_with_mtp():
    """Six chats sharing a 32-token system prefix, concurrently on a pool of 17 pages (about two at a time):
    preemptions happen, later requests hit the prefix cache (the MTP block's KV is cached with the pages), and
    every output equals plain greedy decoding's; no page leaks."""
    base = embedded()
    system = {"role": "system", "content": "You are a poet of the sea, and you answer in the style of old books."}
    qs = ["Tell me about the sea.", "Who is Hamlet?", "你好", "What is love?", "说说曹操。", "Describe the whale."]
    prompts = [base.tokenizer.encode_chat([system, {"role": "user", "content": q}]) for q in qs]
    want = greedy(base, prompts, 60)
    llm = LLM(EMBEDDED_MODEL_DIR, **{**EMBEDDED, "max_num_seqs": 6}, num_gpu_blocks_override=17, speculative_config=spec(2))
    assert greedy(llm, prompts, 60) == want
    e = llm.engine
    assert e.counter("num_preemptions") > 0 and e.counter("prefix_hits") >= 16 and e.spec_stats.num_accepted_tokens > 0
    for pool in e.pools.values():
        pool.check()
        assert pool.free == pool.capacity


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_greedy_with_mtp_equals_greedy_without_under_pd(kv):
    """PD 4 + 4 (dynamic): the MTP block's KV moves with the pages; bf16 and FP8 KV. (Engines are not kept:
    each holds a few hundred compiled programs, and XLA:CPU maps every one into the process.)"""
    kw = dict(max_model_len=256, max_num_seqs=4, mesh=8, prefill_devices=4, kv_cache_dtype=kv)
    base = LLM(EMBEDDED_MODEL_DIR, **kw)
    prompts = chat_prompts(base)
    want = greedy(base, prompts)
    del base
    llm = LLM(EMBEDDED_MODEL_DIR, **kw, speculative_config=spec(3))
    assert greedy(llm, prompts) == want
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert sum(n for (p, d), n in llm.engine.pd_requests.items() if p != d) > 0  # some moved prefill -> decode


def test_server_flag_errors_before_the_model_loads():
    from ernie_jax.serve import cli
    with pytest.raises(SystemExit, match=r"--speculative-config: speculative_config.method='ngram'"):
        cli.main(["--speculative-config", json.dumps({"method": "ngram"})])
    with pytest.raises(SystemExit, match="not valid JSON"):
        cli.main(["--speculative-config", "{num_speculative_tokens: 2}"])
