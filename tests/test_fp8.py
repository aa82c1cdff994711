"""Block-FP8 weights and the FP8 KV cache against an independent oracle of FastDeploy's semantics."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax import CheckpointError, ErnieConfig, ErnieForCausalLM, LLM, SamplingParams, load_pretrained
from ernie_jax.model.kv_cache import KVCache
from ernie_jax.model.weights import abstract_weights
from ernie_jax.quant import BlockFP8, dequantize, fp8_linear, fp8_ragged_dot, quantize_block_fp8
from tests import fp8_reference as ref
from tests.conftest import GOLDEN
from tests.conftest import rewrite_safetensors as _rewrite

SHAPES = [(256, 384), (200, 72), (130, 300), (64, 64)]


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_is_bit_identical_to_fastdeploy(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[:5, :5] *= 1e4  # saturation and very different block scales
    q_ref, s_ref = ref.per_block_cast_to_fp8(w)
    ours = quantize_block_fp8(w)
    np.testing.assert_array_equal(np.asarray(ours.values).view(np.uint8), q_ref.view(np.uint8))
    # XLA may divide by 448 as a multiply by its reciprocal: scales agree to 1 ulp.
    np.testing.assert_allclose(np.asarray(ours.scales), s_ref, rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(np.asarray(dequantize(ours)), ref.dequantize(q_ref, s_ref), rtol=2.5e-7, atol=0)
    assert not np.isnan(np.asarray(ours.values, np.float32)).any()


def test_zero_and_huge_blocks():
    w = np.zeros((130, 5), np.float32)
    q = quantize_block_fp8(w)
    assert np.all(np.asarray(q.values, np.float32) == 0) and np.allclose(q.scales, 1e-4 / 448)
    w = np.ones((128, 128), np.float32)
    w[0, 0], w[1, 1] = 1e6, -1e6
    v = np.asarray(quantize_block_fp8(w).values, np.float32)
    assert v.max() == 448 and v.min() == -448


@pytest.mark.parametrize("T, K, N", [(7, 256, 384), (5, 200, 72), (1, 130, 300), (3, 64, 48)])
def test_w8a8_linear_matches_reference(T, K, N):
    rng = np.random.default_rng(T * K)
    x = ref.bf16_round(rng.standard_normal((T, K)).astype(np.float32))
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    q, s = ref.per_block_cast_to_fp8(w)
    want = ref.w8a8_linear(x, q, s)
    got = np.asarray(fp8_linear(jnp.asarray(x), BlockFP8(jnp.asarray(q), jnp.asarray(s))))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    got = np.asarray(fp8_linear(jnp.asarray(x), BlockFP8(jnp.asarray(q), jnp.asarray(s)), "weight_only"))
    want = ref.weight_only_linear(x, q, s)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_layout_holds_fp8_values_widened_with_the_same_results(dtype):
    """weights.cpu_layout widens FP8 values to f32 or bf16 (XLA:CPU would convert them in every matmul):
    exact, and the w8a8 and weight-only matmuls give the same bits."""
    from ernie_jax.model.weights import _fp8_values_as
    rng = np.random.default_rng(0)
    w = quantize_block_fp8(rng.standard_normal((2, 384, 320)).astype(np.float32))
    wide = _fp8_values_as({"segments": [], "w": w}, dtype)["w"]
    assert wide.values.dtype == dtype and wide.scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(wide.values, np.float32), np.asarray(w.values.astype(jnp.float32)))
    x = jnp.asarray(rng.standard_normal((5, 384)), jnp.bfloat16)
    for compute in ("w8a8", "weight_only"):
        for e in range(2):
            one, one_wide = (BlockFP8(v.values[e], v.scales[e], compute) for v in (w, wide))
            np.testing.assert_array_equal(np.asarray(jax.jit(fp8_linear)(x, one).astype(jnp.float32)),
                                          np.asarray(jax.jit(fp8_linear)(x, one_wide).astype(jnp.float32)))
        sizes = jnp.asarray([2, 3], jnp.int32)
        np.testing.assert_array_equal(np.asarray(fp8_ragged_dot(x, w.with_compute(compute), sizes)),
                                      np.asarray(fp8_ragged_dot(x, wide.with_compute(compute), sizes)))


def test_grouped_w8a8_matches_reference_per_group():
    rng = np.random.default_rng(1)
    G, K, N, sizes = 4, 200, 136, [3, 0, 5, 1]  # an empty group included
    x = ref.bf16_round(rng.standard_normal((sum(sizes), K)).astype(np.float32))
    w = rng.standard_normal((G, K, N)).astype(np.float32) * 0.05
    q, s = ref.per_block_cast_to_fp8(w)
    got = np.asarray(fp8_ragged_dot(jnp.asarray(x), BlockFP8(jnp.asarray(q), jnp.asarray(s)),
                                    jnp.asarray(sizes, jnp.int32)))
    start = 0
    for g, n in enumerate(sizes):
        want = ref.w8a8_linear(x[start:start + n], q[g], s[g])
        assert np.abs(got[start:start + n] - want).max(initial=0) <= 1e-5 * max(np.abs(want).max(initial=0), 1e-6)
        start += n


@functools.lru_cache(maxsize=None)
def fp8_checkpoint(name, quant_dtype, tmp_root):
    dst = f"{tmp_root}/{name}_{quant_dtype}"
    ref.quantize_paddle_checkpoint(str(GOLDEN / name / "paddle"), dst, quant_dtype=quant_dtype)
    return dst


def dequantized_reference(model: ErnieForCausalLM) -> ErnieForCausalLM:
    """The same model with every FP8 weight replaced by the oracle's dequantization (f32)."""
    def deq(x):
        if isinstance(x, BlockFP8):
            return jnp.asarray(ref.dequantize(np.asarray(x.values), np.asarray(x.scales)))
        return x
    w = jax.tree.map(deq, model.weights(), is_leaf=lambda x: isinstance(x, BlockFP8))
    return ErnieForCausalLM(model.config, w, dtype=jnp.float32)


@pytest.mark.parametrize("name, quant_dtype", [("shared_untied", "I8"), ("noshared_tied", "U8"),
                                               ("interval2_headdim", "F8_E4M3")])
def test_fp8_paddle_checkpoint_weight_only_matches_dequantized_reference(golden, tmp_path_factory, name, quant_dtype):
    path = fp8_checkpoint(name, quant_dtype, str(tmp_path_factory.getbasetemp()))
    g = golden(name)
    model = load_pretrained(path, dtype=jnp.float32, fp8_compute="weight_only")
    leaves = jax.tree.leaves(model.weights(), is_leaf=lambda x: isinstance(x, BlockFP8))
    assert sum(isinstance(x, BlockFP8) for x in leaves) >= 6
    reference = dequantized_reference(model)
    ours, want = np.asarray(model(g["input_ids"])), np.asarray(reference(g["input_ids"]))
    assert np.abs(ours - want).max() <= 1e-3 * np.abs(want).max()
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = g["greedy_prompt"].tolist()
    small = dict(max_model_len=32, max_num_seqs=2)
    assert ([o.outputs[0].token_ids for o in LLM(model, **small).generate(prompt_token_ids=prompts, sampling_params=sp)]
            == [o.outputs[0].token_ids for o in LLM(reference, **small).generate(prompt_token_ids=prompts,
                                                                                 sampling_params=sp)])
    if model.mtp is not None:
        assert isinstance(model.mtp["proj"], BlockFP8) if isinstance(model.mtp, dict) else True
        m_ours, m_want = np.asarray(model.mtp_logits(g["input_ids"])), np.asarray(reference.mtp_logits(g["input_ids"]))
        assert np.abs(m_ours - m_want).max() <= 1e-3 * np.abs(m_want).max()


def test_w8a8_model_runs_and_tracks_bf16(golden, tmp_path_factory):
    path = fp8_checkpoint("shared_untied", "I8", str(tmp_path_factory.getbasetemp()))
    g = golden("shared_untied")
    logits = np.asarray(load_pretrained(path, dtype=jnp.float32)(g["input_ids"]))  # default w8a8
    assert np.isfinite(logits).all()
    assert (logits.argmax(-1) == g["logits"].argmax(-1)).mean() >= 0.6


def test_load_time_quantization_equals_offline_quantization(golden, tmp_path_factory):
    path = fp8_checkpoint("shared_untied", "I8", str(tmp_path_factory.getbasetemp()))
    online = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8")
    offline = load_pretrained(path, dtype=jnp.float32)
    a = online.weights()["segments"][1]["experts_up_gate"]
    b = offline.weights()["segments"][1]["experts_up_gate"]
    np.testing.assert_array_equal(np.asarray(a.values).view(np.uint8), np.asarray(b.values).view(np.uint8))
    np.testing.assert_allclose(np.asarray(a.scales), np.asarray(b.scales), rtol=2.5e-7)


def test_fp8_bytes_ratios():
    for preset in ["ernie-4.5-300b-a47b", "ernie-4.5-21b-a3b"]:
        cfg = ErnieConfig.preset(preset)
        nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
        ratio = nbytes(abstract_weights(cfg, quantization="fp8")) / nbytes(abstract_weights(cfg))
        assert ratio <= 0.53, (preset, ratio)
        kv = lambda d: nbytes(jax.eval_shape(lambda: KVCache.create(cfg, 1, 1024, d)))  # noqa: E731
        assert kv(jnp.float8_e4m3fn) / kv(jnp.bfloat16) <= 0.53


def test_fp8_kv_cache_dynamic_and_static_scales(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(GOLDEN / "shared_untied" / "paddle", d)
    llm_ids = [[5, 9, 33, 71, 2, 8]]
    model = load_pretrained(d, dtype=jnp.float32)
    B, T = 1, len(llm_ids[0])
    ids = np.asarray(llm_ids)

    def run(m, kv):
        cache = m.init_cache(B, 16, kv)
        out = m.forward(ids, np.arange(T)[None], cache)
        return np.asarray(out.logits), out.cache
    exact, _ = run(model, "auto")
    dyn, cache = run(model, "fp8")
    assert cache.k[0].dtype == jnp.float8_e4m3fn and cache.is_fp8
    assert np.abs(dyn - exact).max() <= 0.05 * np.abs(exact).max()
    # Static per-KV-head scales from kv_cache_scale.json (absmax/448): a deliberately coarse scale must change
    # the cached values, which proves the static path is used.
    cfg = model.config
    scales = {}
    for i in range(cfg.num_hidden_layers):
        for kv in ("cachek", "cachev"):
            scales[f"ernie.layers.{i}.self_attn.{kv}_matmul.activation_scale"] = [50.0 / 448] * cfg.num_key_value_heads
    (d / "kv_cache_scale.json").write_text(json.dumps(scales))
    static_model = load_pretrained(d, dtype=jnp.float32)
    assert np.allclose(np.asarray(static_model.weights()["segments"][0]["k_scale"]), 50.0 / 448)
    static, cache = run(static_model, "fp8")
    assert np.allclose(np.asarray(cache.k_scale[0][:, :, :T]), 50.0 / 448)
    assert np.abs(static - exact).max() > np.abs(dyn - exact).max()
    np.testing.assert_array_equal(run(static_model, "auto")[0], exact)  # f32/bf16 caches ignore the scales


@pytest.fixture
def fp8_copy(tmp_path, tmp_path_factory):
    dst = tmp_path / "fp8"
    shutil.copytree(fp8_checkpoint("shared_untied", "I8", str(tmp_path_factory.getbasetemp())), dst)
    return dst


def test_scale_of_wrong_shape(fp8_copy):
    key = "ernie.layers.2.mlp.experts.1.down_proj.weight_scale"
    _rewrite(fp8_copy, lambda t, n: t.__setitem__(key, np.ones((2, 2), np.float32)))
    with pytest.raises(CheckpointError, match=f"{key}.*shape \\[2, 2\\], expected \\[1, 1\\]"):
        load_pretrained(fp8_copy)


def test_quant_weight_of_wrong_dtype(fp8_copy):
    key = "ernie.layers.0.self_attn.o_proj.quant_weight"

    def edit(t, n):
        t[key] = t[key].view(np.int8).astype(np.float32)
        n[key] = "F32"
    _rewrite(fp8_copy, edit)
    with pytest.raises(CheckpointError, match=f"{key}.*stored as F32"):
        load_pretrained(fp8_copy)


def test_missing_quantization_config(fp8_copy):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config"):
        load_pretrained(fp8_copy)


def test_corrupt_fp8_shard(fp8_copy):
    f = fp8_copy / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:16] = b"{{{{{{{{"
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt"):
        load_pretrained(fp8_copy)


@pytest.mark.parametrize("name", ["shared_untied", "interval2_headdim"])
def test_accuracy_report_bounds(name):
    """Bounds for benchmarks/fp8_accuracy.py on the tiny random models (measured, then ~2x margin)."""
    from ernie_jax.accuracy import fp8_report
    cfg = ErnieConfig.from_pretrained(GOLDEN / name / "paddle")
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 32)).astype(np.int32)
    r = fp8_report(str(GOLDEN / name / "paddle"), ids)
    assert r["fp8 weight-only"]["kl"] < 0.06 and r["fp8 weight-only"]["top1_agreement"] >= 0.7
    assert r["fp8 w8a8"]["kl"] < 0.1 and r["fp8 w8a8"]["top1_agreement"] >= 0.55
    assert r["fp8 kv cache"]["kl"] < 0.03 and r["fp8 kv cache"]["top1_agreement"] >= 0.75
    assert r["bf16 kv cache"]["kl"] < 1e-3 and r["bf16 kv cache"]["top1_agreement"] >= 0.95
    assert r["bf16 kv cache"]["kl"] < r["fp8 kv cache"]["kl"]
