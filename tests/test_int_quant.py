"""Integer weights (wint8, wint4, w4a8): the quantizer, the reference matmuls, loading, converting, serving."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from converters import dequantize, paddle_to_jax, quantize_int
from ernie_jax import LLM, CheckpointError, SamplingParams, load_pretrained
from ernie_jax.accuracy import logit_metrics
from ernie_jax.quant import (IntWeight, dequantize_int, int_linear, int_ragged_dot, int_values, quantize_int as q_int)
from tests.conftest import GOLDEN, rewrite_safetensors

SCHEMES = [("wint8", -1), ("wint4", -1), ("wint4", 16), ("w4a8", -1)]


def _numpy_quantize(w, qmax, group):
    """An independent reference: symmetric round-to-nearest-even per (group, column)."""
    K, N = w.shape
    g = K if group == -1 else group
    q, s = np.zeros((K, N), np.int64), np.zeros((-(-K // g), N))
    for i in range(0, K, g):
        amax = np.abs(w[i:i + g]).max(axis=0)
        s[i // g] = np.maximum(amax, 1e-30) / qmax
        q[i:i + g] = np.clip(np.rint(w[i:i + g] / s[i // g]), -qmax, qmax)
    return q, s


@pytest.mark.parametrize("bits,group,K,N", [(8, -1, 300, 130), (4, -1, 257, 96), (4, 64, 300, 130), (4, 128, 257, 7)])
def test_quantizer_matches_an_independent_reference(bits, group, K, N):
    w = np.random.default_rng(K + N).standard_normal((K, N)).astype(np.float32) * 0.05
    w[:, 3 % N] = 0  # an all-zero column stays exactly zero
    q = q_int(w, bits, group)
    ref_q, ref_s = _numpy_quantize(w, 127 if bits == 8 else 7, group)
    np.testing.assert_array_equal(np.asarray(int_values(q)), ref_q)
    np.testing.assert_allclose(q.scales, ref_s, rtol=1e-6)
    assert q.values.shape == (K if bits == 8 else -(-K // 2), N) and q.values.dtype == np.int8
    assert np.all(np.asarray(dequantize_int(q))[:, 3 % N] == 0)


def test_int4_packing_round_trips_every_value_with_ties_to_even():
    col = np.arange(-7, 8, dtype=np.float32)  # 15 rows (odd: one padding row), amax 7 so the scale is 1
    w = np.stack([col, -col, col[::-1]], axis=1)
    q = q_int(w, 4)
    assert q.values.shape == (8, 3) and float(q.scales.max()) == 1.0
    np.testing.assert_array_equal(np.asarray(int_values(q)), w.astype(np.int8))
    t = q_int(np.array([[2.5], [7.0], [-3.5], [0.5]], np.float32), 4)
    np.testing.assert_array_equal(np.asarray(int_values(t))[:, 0], [2, 7, -4, 0])


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("bits,group,compute", [(8, -1, "weight_only"), (4, -1, "weight_only"), (4, 64, "weight_only"),
                                                (4, -1, "w4a8")])
def test_linear_matches_its_reference(M, bits, group, compute):
    rng = np.random.default_rng(M)
    K, N = 200, 72  # neither a multiple of the group
    w = q_int(rng.standard_normal((K, N)).astype(np.float32) * 0.05, bits, group, compute)
    x = rng.standard_normal((M, K)).astype(np.float32)
    got = np.asarray(int_linear(jnp.asarray(x), w))
    wq, ws = np.asarray(int_values(w)).astype(np.int64), np.asarray(w.scales)
    if compute == "w4a8":  # int8 per-token activations, int32 accumulation, then both scales
        xs = np.maximum(np.abs(x).max(axis=1), 1e-30) / 127
        xq = np.clip(np.rint(x / xs[:, None]), -127, 127).astype(np.int64)
        want = (xq @ wq) * xs[:, None] * ws[0]
    else:
        want = x.astype(np.float64) @ np.asarray(dequantize_int(w), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("bits,group,compute", [(8, -1, "weight_only"), (4, 32, "weight_only"), (4, -1, "w4a8")])
def test_grouped_matmul_is_each_groups_linear(bits, group, compute):
    rng = np.random.default_rng(3)
    w = q_int(rng.standard_normal((4, 96, 40)).astype(np.float32) * 0.05, bits, group, compute)
    sizes = np.array([5, 0, 9, 2])
    x = rng.standard_normal((16, 96)).astype(np.float32)
    got = np.asarray(int_ragged_dot(jnp.asarray(x), w, jnp.asarray(sizes)))
    start = 0
    for g, n in enumerate(sizes):
        one = IntWeight(w.values[g], w.scales[g], w.bits, w.group, w.rows, w.compute)
        np.testing.assert_allclose(got[start:start + n], np.asarray(int_linear(jnp.asarray(x[start:start + n]), one)),
                                   rtol=1e-5, atol=1e-5)
        start += n
    assert np.all(got[start:] == 0)
    if compute == "weight_only":  # and the reference's dequantized form agrees
        ref = lax.ragged_dot(jnp.asarray(x), dequantize_int(w), jnp.asarray(sizes))
        np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_converted_checkpoint_loads_bit_identically_to_load_time_quantization(tmp_path, scheme, group):
    src = GOLDEN / "shared_untied" / "paddle"
    quantize_int.convert(str(src), str(tmp_path / "q"), scheme, group, quiet=True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["moe_quant_type"] == scheme and cfg.get("weight_group_size", -1) == group
    stored = load_pretrained(tmp_path / "q").weights()
    online = load_pretrained(src, quantization=scheme, quant_group_size=group).weights()
    a, b = jax.tree.leaves(stored), jax.tree.leaves(online)
    assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    leaves = jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, IntWeight))
    kinds = {x.scheme for x in leaves if isinstance(x, IntWeight)}
    assert kinds == ({"w4a8", "wint8"} if scheme == "w4a8" else {scheme})
    # the Orbax format keeps the integers too, and a BF16 export dequantizes them
    paddle_to_jax.convert(str(tmp_path / "q"), str(tmp_path / "orbax"), quiet=True)
    c = jax.tree.leaves(load_pretrained(tmp_path / "orbax").weights())
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, c))
    if scheme == "wint4" and group != -1:
        dequantize.convert(str(tmp_path / "q"), str(tmp_path / "bf16"), quiet=True)
        ids = np.array([[1, 5, 9, 22, 40, 7, 3, 11]])
        deq = load_pretrained(tmp_path / "bf16", dtype=jnp.float32)(ids)
        assert np.abs(np.asarray(deq) - np.asarray(load_pretrained(tmp_path / "q", dtype=jnp.float32)(ids))).max() < 0.2


def test_quantized_models_track_the_float_model(golden):
    g = golden("shared_untied")
    src = GOLDEN / "shared_untied" / "paddle"
    ref = np.asarray(load_pretrained(src, dtype=jnp.float32)(g["input_ids"]))
    kl = {}
    for scheme, group in SCHEMES:
        model = load_pretrained(src, dtype=jnp.float32, quantization=scheme, quant_group_size=group)
        kl[scheme, group] = logit_metrics(ref, np.asarray(model(g["input_ids"])))["kl"]
    # random weights of a 64-wide model: 8-bit stays close, 4-bit is coarse (measured 0.0008 / 0.13 / 0.006)
    assert kl["wint8", -1] < 0.005 and kl["w4a8", -1] < 0.03 and kl["wint4", -1] < 0.4


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_sharded_equals_unsharded(golden, scheme, group):
    """Placed on a mesh (column and row splits of packed int4 rows and their scale groups; W4A8 experts under
    expert parallelism) the logits equal one device's."""
    g = golden("shared_untied")
    src = GOLDEN / "shared_untied" / "paddle"
    one = load_pretrained(src, dtype=jnp.float32, quantization=scheme, quant_group_size=group)
    sharded = load_pretrained(src, dtype=jnp.float32, quantization=scheme, quant_group_size=group,
                              mesh="data=1,expert=2,tensor=4")
    np.testing.assert_allclose(np.asarray(sharded(g["input_ids"])), np.asarray(one(g["input_ids"])), atol=2e-4)


def test_served_through_the_engine(golden):
    g = golden("shared_untied")
    src = str(GOLDEN / "shared_untied" / "paddle")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(src, dtype="float32", quantization="wint4", quant_group_size=16, max_model_len=32, max_num_seqs=1,
              max_num_batched_tokens=16)
    out = llm.generate(prompt_token_ids=g["greedy_prompt"].tolist(), sampling_params=params)
    # the engine's greedy tokens are the quantized model's own argmax at every position (one causal forward)
    for prompt, o in zip(g["greedy_prompt"].tolist(), out):
        ids = list(prompt) + list(o.outputs[0].token_ids)
        logits = np.asarray(llm.model(np.array([ids[:-1]])))[0, len(prompt) - 1:]
        assert logits.argmax(-1).tolist() == list(o.outputs[0].token_ids)


def test_bad_input_names_the_problem(tmp_path):
    src = GOLDEN / "shared_untied" / "paddle"
    with pytest.raises(ValueError, match="quantization='int3'"):
        load_pretrained(src, quantization="int3")
    with pytest.raises(ValueError, match="group-wise scales apply to quantization='wint4' only"):
        load_pretrained(src, quantization="wint8", quant_group_size=64)
    with pytest.raises(ValueError, match="positive even"):
        load_pretrained(src, quantization="wint4", quant_group_size=7)
    # groups must tile every quantized linear's input rows (this model's dense FFN down has 96)
    with pytest.raises(CheckpointError, match=r"quant_group_size=64 does not divide the 96 input rows of "
                                              r"'ernie.layers.0.mlp.down_proj.weight'"):
        load_pretrained(src, quantization="wint4", quant_group_size=64)
    with pytest.raises(SystemExit, match="--group-size:.*does not divide the 96 input rows"):
        quantize_int.convert(str(src), str(tmp_path / "g64"), "wint4", 64, quiet=True)
    with pytest.raises(ValueError, match=r"does not divide the 96 input rows of mtp.layer.down \[96, 64\]"):
        from ernie_jax.model.weights import quantize_weights
        quantize_weights(load_pretrained(src).weights(), scheme="wint4", group=64)
    with pytest.raises(ValueError, match="quant_group_size=64"):
        LLM(str(src), quantization="w4a8", quant_group_size=64)
    # an already-quantized checkpoint is served as stored, never quantized twice
    q = tmp_path / "q"
    quantize_int.convert(str(src), str(q), "wint8", quiet=True)
    with pytest.raises(CheckpointError, match=r"already quantized \(integer, e.g. tensor .ernie.layers.0.self_attn.qkv_proj"):
        load_pretrained(q, quantization="wint4")
    with pytest.raises(CheckpointError, match="--quantization fp8 quantizes a BF16 checkpoint.*already quantized"):
        load_pretrained(q, quantization="fp8")
    with pytest.raises(SystemExit, match="already quantized"):
        quantize_int.convert(str(q), str(tmp_path / "qq"), "wint4", quiet=True)
    # a missing scale, a scale of the wrong shape, integers stored as floats: errors naming the tensor
    key = "ernie.layers.2.mlp.experts.1.down_proj"
    for edit, match in (
            (lambda t, n: t.pop(key + ".weight_scale"), f"missing tensor '{key}.weight_scale'"),
            (lambda t, n: t.__setitem__(key + ".weight_scale", np.ones((2, 2), np.float32)),
             f"{key}.weight_scale.*shape \\[2, 2\\], expected \\[1, 64\\]"),
            (lambda t, n: (t.__setitem__(key + ".quant_weight", t[key + ".quant_weight"].astype(np.float32)),
                           n.__setitem__(key + ".quant_weight", "F32")), f"{key}.quant_weight.*stored as F32")):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(q, bad)
        rewrite_safetensors(bad, edit)
        with pytest.raises(CheckpointError, match=match):
            load_pretrained(bad)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["moe_quant_type"] = "wint2"
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="moe_quant_type 'wint2'"):
        load_pretrained(q)


KERNEL_CASES = [(8, -1, "weight_only"), (4, -1, "weight_only"), (4, 64, "weight_only"), (4, 128, "weight_only"),
                (4, -1, "w4a8")]


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("bits,group,compute", KERNEL_CASES)
def test_kernel_matches_its_reference(M, bits, group, compute):
    """The Pallas-Triton kernel in the interpreter on odd shapes (K = 300, N = 200: neither a multiple of the
    group nor of the tiles). Tolerance 1e-5 of the largest output in f32: the kernel scales exact integer
    sums where the grouped reference dequantizes first, so they round differently."""
    from ernie_jax.ops.base import Platform
    from ernie_jax.ops.int_weight_matmul import OP
    rng = np.random.default_rng(M + bits + group)
    w = q_int(rng.standard_normal((300, 200)).astype(np.float32) * 0.05, bits, group, compute)
    x = jnp.asarray(rng.standard_normal((M, 300)), jnp.float32)
    got, want = OP.get("pallas_triton").fn(x, w, Platform("cpu")), int_linear(x, w)
    assert got.shape == (M, 200) and float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())


@pytest.mark.parametrize("sizes", [[1, 0, 0, 0], [3, 0, 4, 0], [20, 7, 0, 37]])
@pytest.mark.parametrize("bits,group,compute", KERNEL_CASES[:1] + KERNEL_CASES[2:3] + KERNEL_CASES[4:])
def test_grouped_kernel_matches_its_reference(sizes, bits, group, compute):
    from ernie_jax.ops.base import Platform
    from ernie_jax.ops.grouped_int_matmul import OP
    rng = np.random.default_rng(sum(sizes))
    w = q_int(rng.standard_normal((4, 200, 150)).astype(np.float32) * 0.05, bits, group, compute)
    x = jnp.asarray(rng.standard_normal((sum(sizes) + 3, 200)), jnp.float32)
    got = OP.get("pallas_triton").fn(x, w, jnp.asarray(sizes), Platform("cpu"))
    want = int_ragged_dot(x, w, jnp.asarray(sizes))
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())
    assert np.all(np.asarray(got)[sum(sizes):] == 0)


@pytest.mark.parametrize("mesh", [None, "data=1,expert=4,tensor=2"])
def test_model_runs_through_the_integer_kernels(monkeypatch, golden, mesh):
    """A wint4 model (groups of 32) and a W4A8 one placed with the kernels forced (interpreted): every integer
    linear and the grouped expert matmul take them and agree with the XLA path, on one device and per device
    under a mesh (linears split by columns and by rows, experts inside the expert-parallel shard_map);
    groups the kernel's steps cannot follow (16) take the reference and say so."""
    from ernie_jax.model.ernie import ErnieForCausalLM
    from ernie_jax.ops import ExecutionConfig, Platform, base
    from tests.test_ops import record_kernels
    g = golden("shared_untied")
    ids = g["input_ids"][:1, :6]
    ex = ExecutionConfig.select(Platform("cpu"), "pallas", routed_experts="ragged")
    for scheme, group in (("wint4", 32), ("w4a8", -1), ("wint4", 16)):
        model = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization=scheme,
                                quant_group_size=group, mesh=mesh)
        ref = np.asarray(model(ids))
        used = record_kernels(monkeypatch)
        placed = ErnieForCausalLM.from_host(model.config, model.checkpoint_weights(), model.dtype, model.plan, ex)
        out = np.asarray(placed(ids))
        if group == 16:
            assert not used & {"int_weight_matmul_pallas", "grouped_int_matmul_pallas"}
            assert any(op.endswith("int_matmul") and why.endswith("scale groups of 16 rows (the kernel's K steps "
                                                                  "are 64 or 32 rows)") for op, _, why in base.FALLBACKS)
        else:
            assert {"int_weight_matmul_pallas", "grouped_int_matmul_pallas"} <= used
            # only the dense FFN's down (96 rows: 3 groups of 32) cannot split over tensor=2 in whole groups
            assert all(f[2].startswith("down (96, 64)") for f in base.FALLBACKS
                       if f[0] == "int_weight_matmul" and "on mesh" in f[2])
        assert np.abs(out - ref).max() < 1e-4 * np.abs(ref).max()
