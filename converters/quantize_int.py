"""BF16 Paddle checkpoint -> integer weights: wint8, wint4 (per channel or grouped) or w4a8 (FastDeploy's names).

    python -m converters.quantize_int --src ERNIE-4.5-300B-A47B-Paddle --dst ERNIE-4.5-300B-A47B-WINT4 \\
        --scheme wint4 [--group-size 128]

Every linear that the FP8 release quantizes becomes `X.quant_weight` (int8; 4-bit values two per byte along
`in`) + `X.weight_scale` (f32 [ceil(in/group), out], one row when per channel), quantized exactly as
`--quantization SCHEME` does at load (quant/int_weights.py; w4a8: W4A8 routed experts, wint8 elsewhere), so the
written checkpoint loads back bit-identically. Embeddings, norms and the LM head stay BF16, the router F32.
config.json's `quantization_config` records the scheme per part (dense_quant_type / moe_quant_type) and the
group size. The shard structure is kept and one tensor is held at a time (converters/rewrite.py).
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

from converters.rewrite import open_plan, rewrite, tensor_roles, with_quantization_config
from ernie_jax.checkpoint.safetensors_io import CheckpointError
from ernie_jax.model.weights import EXPERT_LEAVES, F32_LEAVES, QUANTIZABLE, int_format
from ernie_jax.config import INT_SCHEMES
from ernie_jax.quant import check_group, packed_rows, quantize_int, scale_rows

class _ToInt:
    def __init__(self, roles: dict[str, tuple[str, str]], scheme: str, group: int):
        self.roles, self.scheme, self.group = roles, scheme, group

    def _format(self, name):
        storage, leaf = self.roles[name]
        return int_format(self.scheme, leaf, self.group) if leaf in QUANTIZABLE else None

    def specs(self, name, shape):
        fmt, leaf = self._format(name), self.roles[name][1]
        if fmt is None:
            return [(name, "F32" if leaf in F32_LEAVES else "BF16", shape)]
        bits, group, _ = fmt
        *lead, K, N = shape
        base = name[: -len(".weight")]
        return [(base + ".quant_weight", "I8", (*lead, packed_rows(K, bits), N)),
                (base + ".weight_scale", "F32", (*lead, scale_rows(K, group), N))]

    def values(self, name, ckpt):
        fmt, leaf = self._format(name), self.roles[name][1]
        arr = ckpt.read(name)
        if fmt is None:
            return [(name, np.asarray(arr, np.float32 if leaf in F32_LEAVES else ml_dtypes.bfloat16))]
        # Read as the loader reads a BF16 checkpoint (bf16 values), so both quantize the same numbers.
        q = quantize_int(np.asarray(arr, ml_dtypes.bfloat16), *fmt)
        base = name[: -len(".weight")]
        return [(base + ".quant_weight", q.values), (base + ".weight_scale", q.scales)]


def quantization_config(scheme: str, group: int) -> dict:
    dense = "wint8" if scheme == "w4a8" else scheme
    config = {"quantization": scheme, "dense_quant_type": dense, "moe_quant_type": scheme, "is_quantized": True}
    if group != -1:
        config["weight_group_size"] = group
    return config


def convert(src: str, dst: str, scheme: str, group: int = -1, quiet: bool = False) -> None:
    if scheme not in INT_SCHEMES:
        raise SystemExit(f"--scheme {scheme!r}: expected one of {list(INT_SCHEMES)}")
    try:
        for leaf in ("qkv", sorted(EXPERT_LEAVES)[0]):
            check_group(*int_format(scheme, leaf, group))
    except ValueError as e:
        raise SystemExit(f"--group-size {group}: {e}") from None
    plan = open_plan(src, "quantize_int")
    roles = tensor_roles(plan)
    quantized = sorted(k for k, (storage, _) in roles.items() if storage != "float")
    if quantized:
        raise SystemExit(f"{src} is already quantized (e.g. {quantized[0]}); quantize_int takes a BF16 checkpoint")
    try:
        plan.check_groups(scheme, group)
    except CheckpointError as e:
        raise SystemExit(f"--group-size: {e}") from None
    rewrite(src, dst, plan, _ToInt(roles, scheme, group), with_quantization_config(quantization_config(scheme, group)),
            "quantize_int", quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.quantize_int", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="BF16 Paddle checkpoint folder")
    ap.add_argument("--dst", required=True, help="output folder")
    ap.add_argument("--scheme", required=True, choices=INT_SCHEMES)
    ap.add_argument("--group-size", type=int, default=-1,
                    help="wint4 only: scales per group of this many input rows (-1: per output channel)")
    args = ap.parse_args(argv)
    convert(args.src, args.dst, args.scheme, args.group_size)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
