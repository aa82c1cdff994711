"""Paddle (or HF) safetensors checkpoint -> ernie_jax Orbax checkpoint, streaming one tensor at a time.

    python -m converters.paddle_to_jax --src ERNIE-4.5-300B-A47B-FP8-Paddle --dst ernie-300b-fp8-jax
    python -m converters.paddle_to_jax --src ERNIE-4.5-300B-A47B-FP8-Paddle --dry-run

--dtype bf16|fp8 chooses the stored precision of the linears (default: as the source stores them; fp8 of a
BF16 source quantizes 128x128 blocks, bf16 of an FP8 or integer source dequantizes; an integer source, from
converters.quantize_int, otherwise stays integer). Peak memory stays near the
largest single tensor. The output is written as DST.partial and renamed only when complete, so an
interrupted run leaves nothing that passes as a checkpoint. `load_pretrained(DST)` and `LLM(DST)` load it.

--dry-run checks the checkpoint against its config.json without converting: every expected tensor present
with the right shape and dtype (from the shard headers; with only model.safetensors.index.json present,
the names, with sizes computed from the config), nothing unexpected, and prints a report by kind.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from converters.progress import Progress
from converters.quantize_fp8 import QUANT_CONFIG
from ernie_jax.checkpoint.orbax_io import OrbaxWriter, write_marker
from ernie_jax.checkpoint.plan import CheckpointPlan
from ernie_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint
from ernie_jax.config import ConfigError, ErnieConfig
from ernie_jax.model.weights import QUANTIZABLE
from ernie_jax.quant import BlockFP8, IntWeight, dequantize, dequantize_int, quantize_block_fp8

_ITEMSIZE = {"float": 2, "fp8": 1, "scale": 4}


def dry_run(src: str, out=sys.stdout) -> dict:
    """Validate and report. Returns the report (also printed)."""
    cfg = ErnieConfig.from_pretrained(src)
    index = os.path.join(src, "model.safetensors.index.json")
    files_present = all(os.path.isfile(os.path.join(src, f)) for f in _index_files(index)) if os.path.isfile(index) \
        else True
    ckpt = SafetensorsCheckpoint(src, index_only=not files_present)
    plan = CheckpointPlan(src, cfg, ckpt)
    plan.validate()
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    total = 0
    for task in plan.tasks:
        for key, shape, storage, _ in plan.keys_of(task):
            info = ckpt.info(key) if key in ckpt else None
            if info is not None:
                n = info.nbytes
            else:  # index only: router and its bias are f32 in every release, other floats bf16
                item = 4 if task.leaf.startswith("router") or task.leaf.endswith("_scale") else _ITEMSIZE[storage]
                n = int(np.prod(shape)) * item
            by_kind[task.kind][0] += 1
            by_kind[task.kind][1] += n
            total += n
    declared = None
    if os.path.isfile(index):
        with open(index) as f:
            declared = json.load(f).get("metadata", {}).get("total_size")
    report = {"layout": plan.layout.name, "data": "headers" if files_present else "index only (no shard files)",
              "tensors": sum(v[0] for v in by_kind.values()), "bytes": total, "declared_total_size": declared,
              "by_kind": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(by_kind.items())},
              "missing": [], "unexpected": [], "mtp": plan.cfg.has_mtp,
              "quantized": cfg.quantization_config is not None}
    print(f"{src}: {plan.layout.name} layout, checked from {report['data']}; every expected tensor present, "
          "nothing unexpected", file=out)
    for kind, v in report["by_kind"].items():
        print(f"  {kind:16s} {v['tensors']:7d} tensors {v['bytes'] / 1e9:12.3f} GB", file=out)
    line = f"  total            {report['tensors']:7d} tensors {total:,} bytes"
    if declared:
        line += f" (index total_size {declared:,}: {100 * (total - declared) / declared:+.5f} %)"
    print(line, file=out)
    return report


def _index_files(index: str) -> list[str]:
    with open(index) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def convert(src: str, dst: str, dtype: str | None = None, quiet: bool = False) -> None:
    cfg = ErnieConfig.from_pretrained(src)
    plan = CheckpointPlan(src, cfg)
    plan.validate()
    stored = {storage for t in plan.tasks for _, _, storage, _ in plan.keys_of(t)}
    dtype = dtype or ("fp8" if "fp8" in stored else "int" if "int" in stored else "bf16")
    if dtype == "fp8" and "int" in stored:
        raise CheckpointError(f"{src}: an integer checkpoint cannot be re-quantized to fp8; convert it as stored "
                              "(no --dtype) or dequantized (--dtype bf16)")
    tmp = dst.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    largest = max((plan.ckpt.info(k).nbytes for t in plan.tasks for k, _, _, _ in plan.keys_of(t) if k in plan.ckpt),
                  default=0)
    # Orbax holds about two copies of a batch while writing it: half the largest tensor keeps the peak near 3x it.
    writer = OrbaxWriter(tmp, batch_bytes=max(largest // 2, 16 << 20))
    progress = None if quiet else Progress(plan.nbytes(), "paddle_to_jax")
    for task in plan.tasks:
        value = plan.read(task, ml_dtypes.bfloat16)
        if dtype == "fp8" and task.leaf in QUANTIZABLE and not isinstance(value, BlockFP8):
            q = quantize_block_fp8(jnp.asarray(value))
            value = BlockFP8(np.asarray(q.values), np.asarray(q.scales), block=q.block)
        elif dtype == "bf16" and isinstance(value, BlockFP8):
            value = np.asarray(dequantize(value, jnp.bfloat16))
        elif dtype == "bf16" and isinstance(value, IntWeight):
            value = np.asarray(dequantize_int(value, jnp.bfloat16))
        writer.add(task.path, value)
        if progress:
            progress.update(sum(plan.ckpt.info(k).nbytes for k, _, _, _ in plan.keys_of(task) if k in plan.ckpt))
    writer.finalize()
    if progress:
        progress.close()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = plan.cfg.num_nextn_predict_layers
    if dtype == "fp8":
        config["quantization_config"] = config.get("quantization_config") or dict(QUANT_CONFIG)
    elif dtype != "int":  # an integer checkpoint keeps its quantization_config
        config.pop("quantization_config", None)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith((".safetensors", ".safetensors.index.json")) and \
                name != "config.json":
            shutil.copy2(path, os.path.join(tmp, name))
    write_marker(tmp, dtype=dtype, fp8_block=128, tensors=len(plan.tasks), source=os.path.abspath(src))
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converters.paddle_to_jax", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="Paddle release (or HF) checkpoint folder")
    ap.add_argument("--dst", help="output folder (required unless --dry-run)")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default=None,
                    help="precision of the stored linears (default: as in the source)")
    ap.add_argument("--dry-run", action="store_true", help="check the checkpoint against config.json and report")
    ap.add_argument("--json", action="store_true", help="with --dry-run: print the report as JSON")
    args = ap.parse_args(argv)
    try:
        if args.dry_run:
            report = dry_run(args.src, out=sys.stderr if args.json else sys.stdout)
            if args.json:
                print(json.dumps(report, indent=2))
            return 0
        if not args.dst:
            ap.error("--dst is required unless --dry-run")
        convert(args.src, args.dst, args.dtype)
        print(f"wrote {args.dst}")
        return 0
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
