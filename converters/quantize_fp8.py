"""BF16 Paddle release -> FP8 Paddle release (block-wise 128x128, FastDeploy semantics).

    python -m converters.quantize_fp8 --src ERNIE-4.5-21B-A3B-Paddle --dst ERNIE-4.5-21B-A3B-FP8-Paddle

Every linear that the FP8 release quantizes (attention qkv/o, dense FFN, experts, shared experts, the MTP
block's linears) becomes `X.quant_weight` (e4m3fn bits) + `X.weight_scale` (f32 [in/128, out/128]);
embeddings, norms and the LM head are written as BF16, the router and its correction bias as F32.
The shard structure is kept and one tensor is held at a time (converters/rewrite.py).
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from converters.rewrite import open_plan, rewrite, tensor_roles, with_quantization_config
from ernie_jax.model.weights import F32_LEAVES, QUANTIZABLE
from ernie_jax.quant import quantize_block_fp8, scale_shape

QUANT_CONFIG = {"dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8", "quantization": "mix_quant"}


class _ToFP8:
    def __init__(self, roles: dict[str, str], quant_dtype: str):
        self.roles, self.quant_dtype = roles, quant_dtype

    def specs(self, name, shape):
        if self.roles[name] == "fp8":
            base = name[: -len(".weight")]
            return [(base + ".quant_weight", self.quant_dtype, shape), (base + ".weight_scale", "F32", scale_shape(shape))]
        return [(name, "F32" if self.roles[name] == "f32" else "BF16", shape)]

    def values(self, name, ckpt):
        arr = ckpt.read(name)
        if self.roles[name] == "fp8":
            q = quantize_block_fp8(jnp.asarray(arr))
            base = name[: -len(".weight")]
            return [(base + ".quant_weight", np.asarray(q.values)), (base + ".weight_scale", np.asarray(q.scales))]
        return [(name, np.asarray(arr, np.float32 if self.roles[name] == "f32" else ml_dtypes.bfloat16))]


def _roles(plan) -> dict[str, str]:
    """Stored tensor name -> "fp8", "f32" or "bf16"."""
    roles = {}
    for key, (storage, leaf) in tensor_roles(plan).items():
        if storage != "float":
            raise SystemExit(f"{plan.path} is already quantized ({key})")
        roles[key] = "fp8" if leaf in QUANTIZABLE else "f32" if leaf in F32_LEAVES else "bf16"
    return roles


def convert(src: str, dst: str, quant_dtype: str = "I8", quiet: bool = False) -> None:
    plan = open_plan(src, "quantize_fp8")
    rewrite(src, dst, plan, _ToFP8(_roles(plan), quant_dtype), with_quantization_config(QUANT_CONFIG), "quantize_fp8",
            quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.quantize_fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="BF16 Paddle checkpoint folder")
    ap.add_argument("--dst", required=True, help="output folder (FP8 Paddle layout)")
    ap.add_argument("--quant-dtype", default="I8", choices=["I8", "U8", "F8_E4M3"],
                    help="safetensors header dtype of quant_weight (same bytes; FastDeploy reads I8)")
    args = ap.parse_args(argv)
    convert(args.src, args.dst, args.quant_dtype)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
