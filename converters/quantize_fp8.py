"""BF16 Paddle release -> FP8 Paddle release (block-wise 128x128, FastDeploy semantics).

    python -m converters.quantize_fp8 --src ERNIE-4.5-21B-A3B-Paddle --dst ERNIE-4.5-21B-A3B-FP8-Paddle

Every linear that the FP8 release quantizes (attention qkv/o, dense FFN, experts, shared experts, the MTP
block's linears) becomes `X.quant_weight` (e4m3fn bits) + `X.weight_scale` (f32 [in/128, out/128]);
embeddings, norms and the LM head are written as BF16, the router and its correction bias as F32.
The shard structure (file names, `mtp/` subfolder, index) is kept. It streams one tensor at a time, and the
output folder appears only when complete (it is written as DST.partial, then renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from converters.progress import Progress
from ernie_jax.checkpoint.plan import CheckpointPlan
from ernie_jax.checkpoint.safetensors_io import SafetensorsCheckpoint, SafetensorsWriter, read_header
from ernie_jax.config import ErnieConfig
from ernie_jax.model.weights import F32_LEAVES, QUANTIZABLE
from ernie_jax.quant import quantize_block_fp8, scale_shape

QUANT_CONFIG = {"dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8", "quantization": "mix_quant"}


def _roles(plan: CheckpointPlan) -> dict[str, str]:
    """Stored tensor name -> "fp8", "f32" or "bf16"."""
    roles = {}
    for task in plan.tasks:
        for key, _, storage, _ in plan.keys_of(task):
            if storage != "float":
                raise SystemExit(f"{plan.path} is already block-FP8 quantized ({key})")
            roles[key] = "fp8" if task.leaf in QUANTIZABLE else "f32" if task.leaf in F32_LEAVES else "bf16"
    return roles


def convert(src: str, dst: str, quant_dtype: str = "I8", quiet: bool = False) -> None:
    cfg = ErnieConfig.from_pretrained(src)
    plan = CheckpointPlan(src, cfg)
    if plan.layout.name != "paddle":
        raise SystemExit(f"{src}: quantize_fp8 writes the Paddle release layout and reads it too; got the "
                         f"{plan.layout.name!r} layout")
    plan.validate()
    roles = _roles(plan)
    ckpt: SafetensorsCheckpoint = plan.ckpt
    tmp = dst.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files = sorted({info.file for info in ckpt.tensors.values()})
    progress = None if quiet else Progress(sum(os.path.getsize(f) for f in files), "quantize_fp8")
    index_maps: dict[str, dict[str, str]] = {}
    for file in files:
        rel = os.path.relpath(file, src)
        os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
        infos = read_header(file)
        specs = []
        for name, info in infos.items():
            if roles[name] == "fp8":
                base = name[: -len(".weight")]
                specs += [(base + ".quant_weight", quant_dtype, info.shape),
                          (base + ".weight_scale", "F32", scale_shape(info.shape))]
            else:
                specs.append((name, "F32" if roles[name] == "f32" else "BF16", info.shape))
        writer = SafetensorsWriter(os.path.join(tmp, rel), specs)
        for name, info in infos.items():
            arr = ckpt.read(name)
            if roles[name] == "fp8":
                q = quantize_block_fp8(jnp.asarray(arr))
                base = name[: -len(".weight")]
                writer.write(base + ".quant_weight", np.asarray(q.values))
                writer.write(base + ".weight_scale", np.asarray(q.scales))
            else:
                writer.write(name, np.asarray(arr, np.float32 if roles[name] == "f32" else ml_dtypes.bfloat16))
            if progress:
                progress.update(info.nbytes)
        writer.close()
        folder = os.path.dirname(rel)
        index_maps.setdefault(folder, {}).update({s[0]: os.path.basename(rel) for s in specs})
    if progress:
        progress.close()
    for folder, weight_map in index_maps.items():
        if os.path.isfile(os.path.join(src, folder, "model.safetensors.index.json")):
            total = sum(SafetensorsCheckpoint(os.path.join(tmp, folder, f)).tensors[k].nbytes
                        for k, f in weight_map.items())
            with open(os.path.join(tmp, folder, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f,
                          indent=2)
    _copy_side_files(src, tmp)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(QUANT_CONFIG)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def _copy_side_files(src: str, dst: str) -> None:
    """generation config, tokenizer and other small non-weight files."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, os.path.join(dst, name))


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
