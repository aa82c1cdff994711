"""Parity with HF transformers on the golden tiny models (tests/make_golden.py), in both on-disk layouts."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import LLM, SamplingParams, load_pretrained
from tests.conftest import GOLDEN, GOLDEN_MODELS

CASES = [(m, layout) for m in GOLDEN_MODELS for layout in ("paddle", "hf")]
TOL = 1e-4


@functools.lru_cache(maxsize=None)
def model(name, layout, dtype=jnp.float32):
    return load_pretrained(GOLDEN / name / layout, dtype=dtype)


@pytest.mark.parametrize("name, layout", CASES)
def test_full_forward_logits_and_routing(golden, name, layout):
    g = golden(name)
    out = model(name, layout).forward(g["input_ids"])
    err = np.abs(np.asarray(out.logits) - g["logits"]).max()
    assert err < TOL, f"max abs logit error {err:.3e}"
    ids = np.concatenate([np.sort(np.asarray(e), axis=-1) for e in out.expert_ids], axis=0)
    np.testing.assert_array_equal(ids, g["topk_experts"])


@pytest.mark.parametrize("name, layout", CASES)
def test_incremental_decode_through_kv_cache(golden, name, layout):
    g = golden(name)
    m = model(name, layout)
    ids = g["input_ids"]
    B, T = ids.shape
    cache = m.init_cache(B, 16)
    pre = 5
    out = m.forward(ids[:, :pre], np.broadcast_to(np.arange(pre), (B, pre)), cache)
    errs = [np.abs(np.asarray(out.logits) - g["logits"][:, :pre]).max()]
    for t in range(pre, T):
        out = m.forward(ids[:, t:t + 1], np.full((B, 1), t), out.cache)
        errs.append(np.abs(np.asarray(out.logits[:, 0]) - g["logits"][:, t]).max())
    assert max(errs) < TOL, f"max abs logit error per step {errs}"


@pytest.mark.parametrize("name, layout", CASES)
def test_greedy_continuations_match_hf_generate(golden, name, layout):
    g = golden(name)
    llm = LLM(model(name, layout), max_model_len=64, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=g["greedy_tokens"].shape[1], ignore_eos=True)
    outs = llm.generate(prompt_token_ids=g["greedy_prompt"].tolist(), sampling_params=sp)
    assert [o.outputs[0].token_ids for o in outs] == g["greedy_tokens"].tolist()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("name", ["shared_untied", "interval2_headdim"])
def test_mtp_logits(golden, name):
    g = golden(name)
    m = model(name, "paddle")  # MTP weights ship in the Paddle layout (main file or mtp/ subfolder)
    assert m.mtp is not None
    err = np.abs(np.asarray(m.mtp_logits(g["input_ids"])) - g["mtp_logits"]).max()
    assert err < TOL, f"max abs MTP logit error {err:.3e}"


def test_bf16_activations_track_fp32(golden):
    g = golden("shared_untied")
    out = model("shared_untied", "paddle", jnp.bfloat16).forward(g["input_ids"])
    logits = np.asarray(out.logits)
    assert model("shared_untied", "paddle", jnp.bfloat16).dtype == jnp.bfloat16
    agree = (logits.argmax(-1) == g["logits"].argmax(-1)).mean()
    assert agree >= 0.9, f"bf16 top-1 agreement {agree:.2f}"
    assert np.abs(logits - g["logits"]).max() < 0.1 * np.abs(g["logits"]).max()
