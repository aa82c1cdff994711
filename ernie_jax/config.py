"""ErnieConfig: the architecture of an ERNIE-4.5 MoE text model, read from either config.json dialect.

Owns: field defaults, the Paddle and HF `config.json` dialects, the FP8 `quantization_config`, presets,
the dense/MoE layer rule, the grouping of layers into scanned segments, and validation.
Field names follow the Paddle release (docs/model.md §1); HF aliases are accepted on read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    """A config.json (or preset, or keyword) that cannot describe a valid ERNIE-4.5 MoE model."""


# What `--quantization` takes (FastDeploy's names): block_wise_fp8 as "fp8", weight-only int8 / int4, W4A8 experts.
QUANTIZATION_SCHEMES = ("fp8", "wint8", "wint4", "w4a8")
INT_SCHEMES = QUANTIZATION_SCHEMES[1:]  # the integer ones (quant/int_weights.py)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A quantized checkpoint's `quantization_config`: the Paddle FP8 release's (FastDeploy semantics,
    docs/model.md) or an integer one written by converters.quantize_int (dense/moe_quant_type "wint8",
    "wint4" or "w4a8", and `weight_group_size`: -1 per output channel, else wint4's group along `in`)."""

    quantization: str = "mix_quant"
    dense_quant_type: str | None = None
    moe_quant_type: str | None = None
    kv_cache_quant_type: str | None = None
    is_quantized: bool = True
    weight_block_size: tuple[int, int] = (128, 128)
    weight_group_size: int = -1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantizationConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"quantization_config must be a JSON object, got {type(d).__name__}")
        if "quantization" not in d:
            raise ConfigError("quantization_config has no 'quantization' key (expected e.g. 'mix_quant')")
        # FastDeploy's rule: without `is_quantized` and without `kv_cache_quant_type` the checkpoint is
        # pre-quantized; with `kv_cache_quant_type`, `is_quantized` must be said explicitly.
        if "is_quantized" in d:
            is_quantized = bool(d["is_quantized"])
        else:
            is_quantized = "kv_cache_quant_type" not in d
        block = tuple(int(b) for b in d.get("weight_block_size", (128, 128)))
        if len(block) != 2 or min(block) <= 0:
            raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {block}")
        return cls(
            quantization=str(d["quantization"]),
            dense_quant_type=d.get("dense_quant_type"),
            moe_quant_type=d.get("moe_quant_type"),
            kv_cache_quant_type=d.get("kv_cache_quant_type"),
            is_quantized=is_quantized,
            weight_block_size=block,  # type: ignore[arg-type]
            weight_group_size=int(d.get("weight_group_size", -1)),
        )

    def scheme_of(self, experts: bool) -> str | None:
        """The quant type of the routed experts' (experts=True) or the other linears' stored weights."""
        return self.moe_quant_type if experts else self.dense_quant_type


@dataclasses.dataclass(frozen=True)
class LayerSegment:
    """A run of consecutive decoder layers of one kind; its weights are stacked and scanned."""

    kind: str  # "dense" or "moe"
    start: int  # first layer index
    count: int


@dataclasses.dataclass(frozen=True)
class ErnieConfig:
    vocab_size: int = 103424
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 28
    num_attention_heads: int = 20
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    compression_ratio: float = 1.0
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    use_bias: bool = False
    tie_word_embeddings: bool = True
    moe_num_experts: int = 64
    moe_k: int = 6
    moe_intermediate_size: int = 1536
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # -1: the last layer
    moe_layer_interval: int = 1
    moe_use_aux_free: bool = True
    moe_gate_act: str = "softmax"
    moe_norm_min: float = 1e-12
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int = 0
    dtype: str = "bfloat16"
    quantization_config: QuantizationConfig | None = None

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        if self.moe_layer_end_index == -1:
            object.__setattr__(self, "moe_layer_end_index", self.num_hidden_layers - 1)
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        else:
            object.__setattr__(self, "eos_token_id", tuple(int(e) for e in self.eos_token_id))
        self._validate()

    # ---- validation -------------------------------------------------------------------------------------
    def _validate(self):
        positive = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                    "moe_layer_interval"]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by num_key_value_heads "
                f"({self.num_key_value_heads}): grouped-query attention needs whole groups")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (ERNIE-4.5 uses 'silu')")
        if self.use_bias:
            raise ConfigError("use_bias=true is not supported: ERNIE-4.5 MoE linears have no bias")
        if self.moe_gate_act != "softmax":
            raise ConfigError(f"moe_gate_act {self.moe_gate_act!r} is not supported (ERNIE-4.5 uses 'softmax')")
        if self.rope_theta <= 0 or self.compression_ratio <= 0:
            raise ConfigError("rope_theta and compression_ratio must be positive")
        if self.num_moe_layers:
            if self.moe_num_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ConfigError("moe_num_experts and moe_intermediate_size must be positive")
            if not 1 <= self.moe_k <= self.moe_num_experts:
                raise ConfigError(f"moe_k ({self.moe_k}) must be in [1, moe_num_experts={self.moe_num_experts}]")
        if self.moe_num_shared_experts < 0:
            raise ConfigError("moe_num_shared_experts must be >= 0")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: only 0 or 1 MTP layer "
                              "is supported (ERNIE-4.5 ships one)")

    # ---- derived shape facts ----------------------------------------------------------------------------
    @property
    def q_size(self) -> int:  # N*D
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # K*D
        return self.num_key_value_heads * self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.moe_num_shared_experts

    def is_moe_layer(self, i: int) -> bool:
        """The HF/PaddleFormers rule; FastDeploy's `i >= start` agrees on every released model."""
        return ((i + 1) % self.moe_layer_interval == 0
                and self.moe_layer_start_index <= i <= self.moe_layer_end_index)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def layer_segments(self) -> tuple[LayerSegment, ...]:
        """Consecutive same-kind layers grouped, e.g. 300B: (dense x3, moe x51)."""
        segs: list[LayerSegment] = []
        for i in range(self.num_hidden_layers):
            kind = "moe" if self.is_moe_layer(i) else "dense"
            if segs and segs[-1].kind == kind:
                segs[-1] = LayerSegment(kind, segs[-1].start, segs[-1].count + 1)
            else:
                segs.append(LayerSegment(kind, i, 1))
        return tuple(segs)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    def replace(self, **changes) -> "ErnieConfig":
        if "num_hidden_layers" in changes and "moe_layer_end_index" not in changes:
            changes["moe_layer_end_index"] = -1
        return dataclasses.replace(self, **changes)

    # ---- reading ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> "ErnieConfig":
        d = dict(d)
        kw: dict[str, Any] = {}
        aliases = {"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k",
                   "torch_dtype": "dtype", "n_shared_experts": "moe_num_shared_experts"}
        for k, v in list(d.items()):
            if k in aliases and aliases[k] not in d:
                d[aliases[k]] = v
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, dict):
            rtype = rope.get("rope_type", rope.get("type", "default"))
            if rtype not in ("default", None):
                raise ConfigError(f"{source}: rope_type {rtype!r} is not supported (ERNIE-4.5 uses plain RoPE)")
            if "rope_theta" in rope and "rope_theta" not in d:
                d["rope_theta"] = rope["rope_theta"]
        if isinstance(d.get("moe_num_experts"), (list, tuple)):
            raise ConfigError(f"{source}: moe_num_experts is a list ({d['moe_num_experts']}); that is the "
                              "multimodal ERNIE-4.5-VL layout, not a text MoE model")
        field_types = {f.name: f for f in dataclasses.fields(cls)}
        for name in field_types:
            if name in d and d[name] is not None and name != "quantization_config":
                kw[name] = d[name]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        if "dtype" in kw:
            kw["dtype"] = str(kw["dtype"]).replace("torch.", "")
        for name, val in list(kw.items()):
            want = field_types[name].type
            if want in ("int", "int | None") and isinstance(val, float) and val.is_integer():
                kw[name] = int(val)
            elif want == "float" and isinstance(val, (int, float)) and not isinstance(val, bool):
                kw[name] = float(val)
            elif want == "int" and not (isinstance(val, int) and not isinstance(val, bool)):
                raise ConfigError(f"{source}: field '{name}' must be an integer, got {val!r}")
        if d.get("quantization_config"):
            kw["quantization_config"] = QuantizationConfig.from_dict(d["quantization_config"])
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ErnieConfig":
        path = os.fspath(path)
        file = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ConfigError(f"no config.json in {path!r}: an ERNIE-4.5 checkpoint folder needs one")
        try:
            with open(file) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        mt = d.get("model_type")
        if mt not in (None, "ernie4_5_moe"):
            raise ConfigError(f"{file}: model_type {mt!r} is not 'ernie4_5_moe'")
        return cls.from_dict(d, source=file)

    def to_dict(self) -> dict[str, Any]:
        """Paddle-dialect config.json content (what the converters write)."""
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        if self.quantization_config is None:
            d.pop("quantization_config")
        else:
            d["quantization_config"]["weight_block_size"] = list(self.quantization_config.weight_block_size)
            if self.quantization_config.weight_group_size == -1:
                d["quantization_config"].pop("weight_group_size")
        d["architectures"] = ["Ernie4_5_MoeForCausalLM"]
        d["model_type"] = "ernie4_5_moe"
        return d

    @classmethod
    def preset(cls, name: str) -> "ErnieConfig":
        try:
            return PRESETS[name.lower()]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None


PRESETS: dict[str, ErnieConfig] = {
    "ernie-4.5-300b-a47b": ErnieConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=54, num_attention_heads=64,
        num_key_value_heads=8, moe_intermediate_size=3584, moe_num_experts=64, moe_k=8,
        moe_num_shared_experts=0, moe_layer_start_index=3, tie_word_embeddings=False,
        num_nextn_predict_layers=1),
    "ernie-4.5-21b-a3b": ErnieConfig(num_nextn_predict_layers=1),
    # Small enough for CPU tests and demos; keeps every feature (dense + MoE segments, shared experts, MTP).
    "tiny": ErnieConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, moe_num_experts=8, moe_k=2,
        moe_num_shared_experts=1, moe_layer_start_index=1, tie_word_embeddings=False,
        max_position_embeddings=4096, num_nextn_predict_layers=1),
    # The benchmark's small random MoE (hidden 512, 8 layers, 16 experts top-4, vocab 8192).
    "bench-512": ErnieConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, moe_intermediate_size=256, moe_num_experts=16, moe_k=4,
        moe_num_shared_experts=0, moe_layer_start_index=1, tie_word_embeddings=False, max_position_embeddings=4096),
}
PRESETS["ernie-4.5-300b-a47b-fp8"] = PRESETS["ernie-4.5-300b-a47b"].replace(
    quantization_config=QuantizationConfig(dense_quant_type="block_wise_fp8", moe_quant_type="block_wise_fp8"))
