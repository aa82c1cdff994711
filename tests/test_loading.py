"""Checkpoint loading: every bad input gives one clear error naming the problem."""

import json
import shutil

import numpy as np
import pytest

from ernie_jax import CheckpointError, ConfigError, load_pretrained
from tests.conftest import GOLDEN
from tests.conftest import rewrite_safetensors as rewrite


def copy_ckpt(tmp_path, name="shared_untied", layout="paddle"):
    dst = tmp_path / f"{name}_{layout}"
    shutil.copytree(GOLDEN / name / layout, dst)
    return dst


def test_folder_without_config(tmp_path):
    d = copy_ckpt(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_pretrained(d)


def test_truncated_safetensors_names_the_file(tmp_path):
    d = copy_ckpt(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_pretrained(d)


def test_corrupt_header(tmp_path):
    d = copy_ckpt(tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[10:20] = b"\x00" * 10
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_pretrained(d)


def test_missing_expert_tensor(tmp_path):
    d = copy_ckpt(tmp_path)
    gone = "ernie.layers.2.mlp.experts.5.down_proj.weight"
    rewrite(d, lambda t, n: t.pop(gone))
    with pytest.raises(CheckpointError, match=f"missing tensor '{gone}'"):
        load_pretrained(d)


def test_misshaped_tensor_names_expected_and_found(tmp_path):
    d = copy_ckpt(tmp_path)
    key = "ernie.layers.1.self_attn.qkv_proj.weight"
    rewrite(d, lambda t, n: t.__setitem__(key, t[key][:, :-16]))
    with pytest.raises(CheckpointError) as e:
        load_pretrained(d)
    msg = str(e.value)
    assert key in msg and "model.safetensors" in msg and "[64, 112]" in msg and "[64, 128]" in msg


def test_unexpected_tensor(tmp_path):
    d = copy_ckpt(tmp_path)
    rewrite(d, lambda t, n: t.__setitem__("ernie.layers.9.mlp.gate.weight", np.zeros((64, 8), np.float32)))
    with pytest.raises(CheckpointError, match="unexpected tensor.*ernie.layers.9.mlp.gate.weight"):
        load_pretrained(d)


def test_quantized_weight_dtype_in_bf16_slot(tmp_path):
    d = copy_ckpt(tmp_path)
    key = "ernie.layers.0.self_attn.o_proj.weight"

    def edit(t, n):
        t[key] = np.zeros(t[key].shape, np.int8)
        n[key] = "I8"
    rewrite(d, edit)
    with pytest.raises(CheckpointError, match=f"{key}.*stored as I8"):
        load_pretrained(d)


def test_heads_not_divisible(tmp_path):
    d = copy_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_attention_heads \\(4\\) is not divisible by num_key_value_heads \\(3\\)"):
        load_pretrained(d)


def test_sharded_index_with_missing_shard(tmp_path):
    d = copy_ckpt(tmp_path, "noshared_tied")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_pretrained(d)


def test_paddleformers_native_layout_is_refused(tmp_path):
    d = copy_ckpt(tmp_path)

    def edit(t, n):
        for k in list(t):
            new = "model." + k[len("ernie."):] if k.startswith("ernie.") else k
            t[new] = t.pop(k)
            n[new] = n.pop(k)
    rewrite(d, edit)
    with pytest.raises(CheckpointError, match="PaddleFormers 1.x"):
        load_pretrained(d)


def test_tied_config_with_own_lm_head_is_refused(tmp_path):
    d = copy_ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        load_pretrained(d)


def test_u16_bf16_and_f32_storage_load_identically(golden):
    """U16 (Paddle's bf16 bits), BF16 and F32 headers hold the same bf16-exact numbers."""
    import jax.numpy as jnp
    g = golden("shared_untied")
    a = load_pretrained(GOLDEN / "shared_untied" / "paddle", dtype=jnp.float32)  # U16 + F32
    b = load_pretrained(GOLDEN / "shared_untied" / "hf", dtype=jnp.float32)  # F32
    la, lb = np.asarray(a(g["input_ids"])), np.asarray(b(g["input_ids"]))
    assert np.abs(la - lb).max() < 1e-5
