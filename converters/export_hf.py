"""A Paddle-layout checkpoint (BF16, FP8 or integer) -> the HF transformers layout in BF16.

    python -m converters.export_hf --src ernie_jax/assets/ernie-4.5-tiny-fp8 --dst tiny-hf [--drop-mtp]

For tools that read the HF layout: transformers' `Ernie4_5_MoeForCausalLM`, and llama.cpp's
`convert_hf_to_gguf.py` (architecture `ernie4_5-moe`), which is how a GGUF of the same weights is made for the
side-by-side comparison (`python convert_hf_to_gguf.py tiny-hf --outtype bf16`). Each stored tensor becomes the
HF layout's tensors for the same weight (checkpoint/layouts.py, read backwards): fused [Q|K|V] and [gate|up]
split into q/k/v and gate/up, linears transposed to [out, in], one tensor per expert; quantized weights are
dequantized and rounded once to BF16; the router and its correction bias stay F32. `--drop-mtp` leaves out the
MTP block (and sets num_nextn_predict_layers to 0) for readers that do not know it. Static FP8 KV-cache scales
have no HF name and are left out. ernie_jax loads the result (its HF layout path) with the same logits in f32.
The shard structure is kept and one tensor is held at a time (converters/rewrite.py).
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

from converters.rewrite import open_plan, rewrite
from ernie_jax.checkpoint.layouts import HF, Cat, OneOf, Src
from ernie_jax.checkpoint.plan import CheckpointPlan, TensorTask
from ernie_jax.model.weights import F32_LEAVES


def _hf_recipe(task: TensorTask):
    """(HF key prefix, the HF recipe) of a Paddle plan task, or None for a weight HF has no name for."""
    if task.path[0] == "layers":
        prefix, table = HF.layer_prefix.format(i=task.path[1]), HF.layer
    elif task.path[0] == "mtp" and task.path[1] == "layer":
        prefix, table = HF.mtp_layer_prefix, HF.layer
    elif task.path[0] == "mtp":
        prefix, table = "", HF.mtp
    else:
        prefix, table = "", HF.top
    recipe = table.get(task.leaf)
    while isinstance(recipe, OneOf):  # the per-expert (Hub) form
        recipe = recipe.options[0]
    return None if recipe is None else (prefix, recipe)


class _ToHF:
    def __init__(self, plan: CheckpointPlan, drop_mtp: bool):
        self.plan, self.dims = plan, plan.dims
        self.tasks: dict[str, TensorTask | None] = {}  # stored name -> the task it feeds (None: dropped)
        for task in plan.tasks:
            keys = [k for k, _, storage, _ in plan.keys_of(task)]
            keep = _hf_recipe(task) is not None and not (drop_mtp and task.path[0] == "mtp")
            for i, key in enumerate(keys):
                self.tasks[key] = task if keep and i == 0 else None  # the first stored tensor carries the task
        self.dropped = sorted({t.leaf for t in plan.tasks if _hf_recipe(t) is None})

    def _parts(self, task: TensorTask) -> list[tuple[str, Src]]:
        prefix, recipe = _hf_recipe(task)
        parts = recipe.parts if isinstance(recipe, Cat) else (recipe,)
        return [(prefix + s.key.format(e=task.expert), s) for s in parts]

    def _shape(self, s: Src) -> tuple[int, ...]:
        return tuple(self.dims[d] for d in s.shape)

    def specs(self, name, shape):
        task = self.tasks.get(name)
        if task is None:
            return []
        dtype = "F32" if task.leaf in F32_LEAVES else "BF16"
        return [(key, dtype, self._shape(s)) for key, s in self._parts(task)]

    def values(self, name, ckpt):
        task = self.tasks.get(name)
        if task is None:
            return []
        from ernie_jax.quant import BlockFP8, IntWeight, dequantize, dequantize_int
        w = self.plan.read(task, np.float32)  # [in, out], the Paddle orientation
        if isinstance(w, BlockFP8):
            w = np.asarray(dequantize(w))
        elif isinstance(w, IntWeight):
            w = np.asarray(dequantize_int(w))
        dtype = np.float32 if task.leaf in F32_LEAVES else ml_dtypes.bfloat16
        out, start = [], 0
        for key, s in self._parts(task):
            if s.transpose:  # an [out_part, in] tensor: its rows are a slice of our output columns
                width = self.dims[s.shape[0]]
                part = np.swapaxes(w[..., start:start + width], -1, -2)
                start += width
            else:
                part = w
            out.append((key, np.ascontiguousarray(part.reshape(self._shape(s)), dtype)))
        return out


def _edit_config(drop_mtp: bool):
    def edit(config: dict) -> dict:
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        config.update(architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe", dtype="bfloat16")
        if drop_mtp:
            config["num_nextn_predict_layers"] = 0
        return config
    return edit


def convert(src: str, dst: str, drop_mtp: bool = False, quiet: bool = False) -> list[str]:
    """Write the HF-layout copy; returns the leaves left out (no HF name), e.g. static KV-cache scales."""
    plan = open_plan(src, "export_hf")
    rewriter = _ToHF(plan, drop_mtp)
    rewrite(src, dst, plan, rewriter, _edit_config(drop_mtp), "export_hf", quiet)
    return rewriter.dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.export_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="Paddle-layout checkpoint folder (BF16, FP8 or integer)")
    ap.add_argument("--dst", required=True, help="output folder (HF transformers layout, BF16)")
    ap.add_argument("--drop-mtp", action="store_true", help="leave out the MTP block")
    args = ap.parse_args(argv)
    dropped = convert(args.src, args.dst, args.drop_mtp)
    if dropped:
        print(f"left out (no HF name): {', '.join(dropped)}")
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
