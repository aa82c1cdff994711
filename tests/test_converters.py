"""Converters: quantize_fp8 against the independent oracle, paddle_to_jax round trips, dry runs."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from converters import paddle_to_jax, quantize_fp8
from ernie_jax import LLM, CheckpointError, SamplingParams, load_pretrained
from tests import fp8_reference as ref
from tests.conftest import GOLDEN, GOLDEN_MODELS

PUBLISHED_300B_FP8_BYTES = 302_322_646_656


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_quantize_fp8_matches_fastdeploy_oracle(tmp_path, name):
    ours, oracle = tmp_path / "ours", tmp_path / "oracle"
    quantize_fp8.convert(str(GOLDEN / name / "paddle"), str(ours), quiet=True)
    ref.quantize_paddle_checkpoint(str(GOLDEN / name / "paddle"), str(oracle), quant_dtype="I8")
    a, b = ref.load_checkpoint(str(ours)), ref.load_checkpoint(str(oracle))
    assert set(a) == set(b)
    for key in a:
        assert a[key][0] == b[key][0], key
        if key.endswith(".weight_scale"):
            np.testing.assert_allclose(a[key][1], b[key][1], rtol=2.5e-7, err_msg=key)
        else:
            np.testing.assert_array_equal(np.asarray(a[key][1]).view(np.uint8), np.asarray(b[key][1]).view(np.uint8))
    assert json.loads((ours / "config.json").read_text())["quantization_config"]["quantization"] == "mix_quant"
    assert not os.path.exists(str(ours) + ".partial")


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_paddle_to_jax_round_trip(golden, tmp_path, name):
    dst = tmp_path / "jax"
    paddle_to_jax.convert(str(GOLDEN / name / "paddle"), str(dst), quiet=True)
    g = golden(name)
    model = load_pretrained(dst, dtype=jnp.float32)
    assert np.abs(np.asarray(model(g["input_ids"])) - g["logits"]).max() < 1e-4
    if "mtp_logits" in g:
        assert np.abs(np.asarray(model.mtp_logits(g["input_ids"])) - g["mtp_logits"]).max() < 1e-4
    if name == "shared_untied":  # and straight onto a device mesh
        sharded = load_pretrained(dst, dtype=jnp.float32, mesh="data=1,expert=8,tensor=1")
        assert len(sharded.device_bytes()) == 8
        assert np.abs(np.asarray(sharded(g["input_ids"])) - g["logits"]).max() < 1e-4
    out = LLM(str(dst), dtype="float32", max_model_len=32, max_num_seqs=2).generate(
        prompt_token_ids=g["greedy_prompt"].tolist(),
        sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == g["greedy_tokens"].tolist()


def test_paddle_to_jax_fp8_equals_load_time_quantization(golden, tmp_path):
    dst = tmp_path / "jax-fp8"
    paddle_to_jax.convert(str(GOLDEN / "shared_untied" / "paddle"), str(dst), dtype="fp8", quiet=True)
    g = golden("shared_untied")
    a = load_pretrained(dst, dtype=jnp.float32, fp8_compute="weight_only")(g["input_ids"])
    b = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32, quantization="fp8",
                        fp8_compute="weight_only")(g["input_ids"])
    assert np.abs(np.asarray(a) - np.asarray(b)).max() < 1e-5
    # and an FP8 source converts to an FP8 orbax checkpoint by default
    fp8_src = tmp_path / "fp8-paddle"
    quantize_fp8.convert(str(GOLDEN / "shared_untied" / "paddle"), str(fp8_src), quiet=True)
    paddle_to_jax.convert(str(fp8_src), str(tmp_path / "jax-from-fp8"), quiet=True)
    c = load_pretrained(tmp_path / "jax-from-fp8", dtype=jnp.float32, fp8_compute="weight_only")(g["input_ids"])
    assert np.abs(np.asarray(c) - np.asarray(b)).max() < 1e-5


def test_interrupted_conversion_leaves_no_checkpoint(tmp_path, monkeypatch):
    dst = tmp_path / "jax"
    calls = {"n": 0}
    original = paddle_to_jax.CheckpointPlan.read

    def failing_read(self, task, dtype):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return original(self, task, dtype)
    monkeypatch.setattr(paddle_to_jax.CheckpointPlan, "read", failing_read)
    with pytest.raises(KeyboardInterrupt):
        paddle_to_jax.convert(str(GOLDEN / "shared_untied" / "paddle"), str(dst), quiet=True)
    assert not dst.exists()
    partial = str(dst) + ".partial"
    with pytest.raises((CheckpointError, Exception)) as e:
        load_pretrained(partial)
    assert "safetensors" in str(e.value) or "config.json" in str(e.value)


def fastdeploy_300b_fp8_index(folder):
    """The 300B-A47B-FP8 release's tensor names, written from docs/model.md §3 and §4 alone."""
    lin = lambda p: [p + ".quant_weight", p + ".weight_scale"]  # noqa: E731
    names = ["ernie.embed_tokens.weight", "ernie.norm.weight", "lm_head.weight"]
    for i in range(54):
        p = f"ernie.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += lin(p + "self_attn.qkv_proj") + lin(p + "self_attn.o_proj")
        if i < 3:
            names += lin(p + "mlp.up_gate_proj") + lin(p + "mlp.down_proj")
        else:
            names += [p + "mlp.gate.weight", p + "mlp.moe_statics.e_score_correction_bias"]
            for e in range(64):
                names += lin(p + f"mlp.experts.{e}.up_gate_proj") + lin(p + f"mlp.experts.{e}.down_proj")
    m = "ernie.mtp_block.0."
    names += [m + "input_layernorm.weight", m + "post_attention_layernorm.weight"]
    names += lin(m + "self_attn.qkv_proj") + lin(m + "self_attn.o_proj") + lin(m + "mlp.up_gate_proj")
    names += lin(m + "mlp.down_proj") + lin("ernie.mtp_linear_proj.0")
    names += ["ernie.mtp_emb_norm.0.weight", "ernie.mtp_hidden_norm.0.weight"]
    os.makedirs(folder, exist_ok=True)
    weight_map = {n: f"model-{k * 61 // len(names) + 1:05d}-of-00061.safetensors" for k, n in enumerate(names)}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": PUBLISHED_300B_FP8_BYTES}, "weight_map": weight_map}, f)
    config = {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 54, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 103424, "max_position_embeddings": 131072,
              "rope_theta": 500000, "rms_norm_eps": 1e-5, "moe_num_experts": 64, "moe_k": 8,
              "moe_intermediate_size": 3584, "moe_layer_start_index": 3, "moe_layer_end_index": 53,
              "moe_layer_interval": 1, "moe_num_shared_experts": 0, "moe_use_aux_free": True,
              "tie_word_embeddings": False, "use_bias": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
              "quantization_config": {"dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8",
                                      "quantization": "mix_quant"}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return weight_map


def test_dry_run_accepts_the_300b_fp8_release_index(tmp_path):
    fastdeploy_300b_fp8_index(tmp_path)
    report = paddle_to_jax.dry_run(str(tmp_path))
    assert report["data"].startswith("index only") and report["mtp"] and report["quantized"]
    assert abs(report["bytes"] - PUBLISHED_300B_FP8_BYTES) / PUBLISHED_300B_FP8_BYTES < 1e-4
    assert report["by_kind"]["experts"]["tensors"] == 51 * 64 * 4


def test_dry_run_names_missing_and_unexpected_tensors(tmp_path):
    weight_map = fastdeploy_300b_fp8_index(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    gone = "ernie.layers.40.mlp.experts.17.down_proj.weight_scale"
    del weight_map[gone]
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"missing tensor '{gone}'"):
        paddle_to_jax.dry_run(str(tmp_path))
    weight_map[gone] = "model-00050-of-00061.safetensors"
    weight_map["ernie.layers.60.self_attn.o_proj.quant_weight"] = "model-00061-of-00061.safetensors"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="unexpected tensor.*ernie.layers.60"):
        paddle_to_jax.dry_run(str(tmp_path))


def test_dry_run_cli_json(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "converters.paddle_to_jax", "--src",
                          str(GOLDEN / "noshared_tied" / "paddle"), "--dry-run", "--json"],
                         capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["data"] == "headers" and report["bytes"] == report["declared_total_size"]
    # the same entry point on a folder with no config.json (in this process: a second interpreter costs ~10 s)
    assert paddle_to_jax.main(["--src", str(tmp_path), "--dry-run"]) != 0
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_export_hf_equals_the_transformers_save(golden, tmp_path, name):
    """The HF-layout export of a Paddle checkpoint holds transformers' own save of the same model (bf16), plus
    the MTP block unless dropped, and ernie_jax reads it back with the same logits."""
    from converters import export_hf
    from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint
    src = GOLDEN / name / "paddle"
    export_hf.convert(str(src), str(tmp_path / "hf"), drop_mtp=True, quiet=True)
    ours, theirs = SafetensorsCheckpoint(str(tmp_path / "hf")), SafetensorsCheckpoint(str(GOLDEN / name / "hf"))
    assert set(ours.keys()) == set(theirs.keys())
    for key in theirs.keys():
        want = np.asarray(theirs.read(key), np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(ours.read(key), np.float32), want, err_msg=key)
    g = golden(name)
    export_hf.convert(str(src), str(tmp_path / "hf-mtp"), quiet=True)
    for folder in ("hf", "hf-mtp"):
        got = load_pretrained(tmp_path / folder, dtype=jnp.float32)(g["input_ids"])
        assert np.abs(np.asarray(got) - g["logits"]).max() < 1e-4
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_export_hf_of_the_fp8_release_equals_its_bf16_export(tmp_path):
    """The embedded FP8 model through export_hf (dequantized, rounded once to bf16) and through
    converters.dequantize (the Paddle layout) are the same weights: equal logits, and the MTP head too."""
    from converters import dequantize, export_hf
    from ernie_jax.assets import EMBEDDED_MODEL_DIR
    export_hf.convert(EMBEDDED_MODEL_DIR, str(tmp_path / "hf"), quiet=True)
    dequantize.convert(EMBEDDED_MODEL_DIR, str(tmp_path / "bf16"), quiet=True)
    ids = np.array([[1, 300, 42, 77, 1500, 9]])
    a, b = (load_pretrained(tmp_path / f, dtype=jnp.float32) for f in ("hf", "bf16"))
    np.testing.assert_array_equal(np.asarray(a(ids)), np.asarray(b(ids)))
    np.testing.assert_array_equal(np.asarray(a.mtp_logits(ids)), np.asarray(b.mtp_logits(ids)))
    for f in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / f).is_file()
