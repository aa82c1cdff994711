import json

import pytest

from ernie_jax import ConfigError, ErnieConfig, param_counts
from ernie_jax.config import LayerSegment
from tests.conftest import GOLDEN


def test_presets_match_the_spec():
    big = ErnieConfig.preset("ernie-4.5-300b-a47b")
    assert (big.hidden_size, big.num_hidden_layers, big.moe_num_experts, big.moe_k, big.head_dim) == (8192, 54, 64, 8, 128)
    assert big.layer_segments() == (LayerSegment("dense", 0, 3), LayerSegment("moe", 3, 51))
    assert big.q_size + 2 * big.kv_size == 10240
    small = ErnieConfig.preset("ernie-4.5-21b-a3b")
    assert small.layer_segments() == (LayerSegment("dense", 0, 1), LayerSegment("moe", 1, 27))
    assert small.tie_word_embeddings and small.moe_num_shared_experts == 2
    # docs/model.md §7: 299.48 B total / 47.08 B active; 21.83 B / 3.35 B (tied head included)
    c = param_counts(big)
    assert round(c["total"] / 1e9, 2) == 299.48 and round(c["active"] / 1e9, 2) == 47.08
    c = param_counts(small)
    assert round(c["total"] / 1e9, 2) == 21.83 and round(c["active"] / 1e9, 2) == 3.35


def test_hashable_and_frozen():
    cfg = ErnieConfig.preset("tiny")
    assert hash(cfg) == hash(ErnieConfig.preset("tiny"))
    with pytest.raises(Exception):
        cfg.hidden_size = 3


def test_paddle_and_hf_dialects_agree():
    for name in ["shared_untied", "interval2_headdim"]:
        paddle = ErnieConfig.from_pretrained(GOLDEN / name / "paddle")
        hf = ErnieConfig.from_pretrained(GOLDEN / name / "hf")
        for field in ["hidden_size", "num_hidden_layers", "head_dim", "rope_theta", "moe_k", "moe_num_experts",
                      "moe_num_shared_experts", "moe_layer_interval", "moe_layer_end_index", "tie_word_embeddings"]:
            assert getattr(paddle, field) == getattr(hf, field), field
        assert paddle.layer_segments() == hf.layer_segments()
    cfg = ErnieConfig.from_pretrained(GOLDEN / "interval2_headdim" / "paddle")
    assert cfg.head_dim == 32 and [cfg.is_moe_layer(i) for i in range(5)] == [False, True, False, True, False]


def test_quantization_config_fastdeploy_rules(tmp_path):
    base = json.loads((GOLDEN / "shared_untied" / "paddle" / "config.json").read_text())
    qc = {"dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8", "quantization": "mix_quant"}
    cfg = ErnieConfig.from_dict({**base, "quantization_config": qc})
    assert cfg.quantization_config.is_quantized and cfg.quantization_config.weight_block_size == (128, 128)
    cfg = ErnieConfig.from_dict({**base, "quantization_config": {**qc, "kv_cache_quant_type": "float8_e4m3fn"}})
    assert not cfg.quantization_config.is_quantized  # FastDeploy: must then be said explicitly
    cfg = ErnieConfig.from_dict({**base, "quantization_config": {**qc, "kv_cache_quant_type": "float8_e4m3fn",
                                                                 "is_quantized": True}})
    assert cfg.quantization_config.is_quantized and cfg.quantization_config.kv_cache_quant_type == "float8_e4m3fn"
    with pytest.raises(ConfigError, match="quantization"):
        ErnieConfig.from_dict({**base, "quantization_config": {"dense_quant_type": "block_wise_fp8"}})


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not divisible by num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"moe_k": 9}, "moe_k"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_bias": True}, "use_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, "rope_type"),
    ({"num_hidden_layers": "four"}, "num_hidden_layers"),
])
def test_invalid_configs_name_the_problem(tmp_path, change, message):
    base = json.loads((GOLDEN / "shared_untied" / "paddle" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(ConfigError, match=message) as e:
        ErnieConfig.from_pretrained(tmp_path)
    assert "config.json" in str(e.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ErnieConfig.from_pretrained(tmp_path)
