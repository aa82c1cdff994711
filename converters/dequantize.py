"""A quantized Paddle checkpoint (the FP8 release, or an integer one) -> BF16, the layout of the BF16 release.

    python -m converters.dequantize --src ERNIE-4.5-21B-A3B-FP8-Paddle --dst ERNIE-4.5-21B-A3B-BF16

Every `X.quant_weight` + `X.weight_scale` pair becomes `X.weight` in BF16 (the dequantized values rounded
once); everything else is copied, and config.json loses its `quantization_config`. For tools that take only
BF16 weights (other quantizers, llama.cpp's converter) and for accuracy tables measured from a BF16 source
(the embedded model ships as FP8). The shard structure is kept and one tensor is held at a time
(converters/rewrite.py).
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

from converters.rewrite import open_plan, rewrite, tensor_roles, with_quantization_config
from ernie_jax.checkpoint.plan import CheckpointPlan


class _ToBF16:
    def __init__(self, plan: CheckpointPlan):
        self.plan = plan
        self.tasks = {key: task for task in plan.tasks for key, _, storage, _ in plan.keys_of(task)
                      if storage in ("fp8", "int")}
        self.roles = tensor_roles(plan)

    def specs(self, name, shape):
        storage = self.roles[name][0]
        if storage == "scale":
            return []
        if storage in ("fp8", "int"):
            task = self.tasks[name]
            return [(name[: -len(".quant_weight")] + ".weight", "BF16", self._shape(task))]
        return [(name, self.plan.ckpt.info(name).dtype, shape)]

    def _shape(self, task):
        return tuple(self.plan.dims[d] for d in task.recipe.shape)

    def values(self, name, ckpt):
        storage = self.roles[name][0]
        if storage == "scale":
            return []
        if storage in ("fp8", "int"):
            from ernie_jax.quant import BlockFP8, dequantize, dequantize_int
            w = self.plan.read(self.tasks[name], np.float32)
            deq = dequantize(w) if isinstance(w, BlockFP8) else dequantize_int(w)
            return [(name[: -len(".quant_weight")] + ".weight", np.asarray(deq).astype(ml_dtypes.bfloat16))]
        return [(name, ckpt.read(name))]


def convert(src: str, dst: str, quiet: bool = False) -> None:
    plan = open_plan(src, "dequantize")
    if not any(storage in ("fp8", "int") for storage, _ in tensor_roles(plan).values()):
        raise SystemExit(f"{src} holds no quantized tensors; nothing to dequantize")
    rewrite(src, dst, plan, _ToBF16(plan), with_quantization_config(None), "dequantize", quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.dequantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="quantized Paddle checkpoint folder")
    ap.add_argument("--dst", required=True, help="output folder (BF16)")
    args = ap.parse_args(argv)
    convert(args.src, args.dst)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
