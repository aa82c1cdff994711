"""Converter memory and throughput on a synthetic multi-shard BF16 Paddle checkpoint.

    python benchmarks/convert_checkpoint.py --gb 2.2 --workdir /tmp/convbench

Writes a random-weight checkpoint of about `--gb` GB in the Paddle release layout (several shards and an
index), then runs each converter in its own process under /usr/bin/time -v and reports peak RSS (against
the acceptance bound 3 x largest tensor + 500 MB), wall time, throughput, and the disk's own sequential read
speed (dd with O_DIRECT, so the page cache does not flatter it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ernie_jax.checkpoint.safetensors_io import SafetensorsWriter  # noqa: E402


def synthetic_config(gb: float) -> dict:
    # hidden 2048, 16 experts of width 2048: one MoE layer is ~0.4 GB of bf16 experts.
    H, Fm, E = 2048, 2048, 16
    per_layer = E * 3 * H * Fm * 2
    moe_layers = max(1, round(gb * 1e9 / per_layer))
    return {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_size": H,
            "intermediate_size": 4096, "num_hidden_layers": moe_layers + 1, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 32768, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 4096, "moe_num_experts": E, "moe_k": 4, "moe_intermediate_size": Fm,
            "moe_num_shared_experts": 0, "moe_layer_start_index": 1, "moe_layer_end_index": moe_layers,
            "moe_layer_interval": 1, "tie_word_embeddings": False, "use_bias": False, "hidden_act": "silu",
            "num_nextn_predict_layers": 0, "dtype": "bfloat16"}


def tensor_list(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    H, V, D = c["hidden_size"], c["vocab_size"], c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * D
    out = [("ernie.embed_tokens.weight", (V, H), "BF16"), ("ernie.norm.weight", (H,), "BF16"),
           ("lm_head.weight", (H, V), "BF16")]
    for i in range(c["num_hidden_layers"]):
        p = f"ernie.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), "BF16"), (p + "post_attention_layernorm.weight", (H,), "BF16"),
                (p + "self_attn.qkv_proj.weight", (H, qkv), "BF16"), (p + "self_attn.o_proj.weight", (H, H), "BF16")]
        if i < c["moe_layer_start_index"]:
            F = c["intermediate_size"]
            out += [(p + "mlp.up_gate_proj.weight", (H, 2 * F), "BF16"), (p + "mlp.down_proj.weight", (F, H), "BF16")]
        else:
            Fm = c["moe_intermediate_size"]
            out += [(p + "mlp.gate.weight", (H, c["moe_num_experts"]), "F32"),
                    (p + "mlp.moe_statics.e_score_correction_bias", (1, c["moe_num_experts"]), "F32")]
            for e in range(c["moe_num_experts"]):
                out += [(p + f"mlp.experts.{e}.up_gate_proj.weight", (H, 2 * Fm), "BF16"),
                        (p + f"mlp.experts.{e}.down_proj.weight", (Fm, H), "BF16")]
    return out


def write_checkpoint(folder: str, gb: float) -> tuple[int, int]:
    """Returns (total bytes, largest tensor bytes)."""
    os.makedirs(folder, exist_ok=True)
    c = synthetic_config(gb)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    tensors = tensor_list(c)
    size = lambda t: int(np.prod(t[1])) * (4 if t[2] == "F32" else 2)  # noqa: E731
    shards, cur, acc = [], [], 0
    for t in tensors:  # ~500 MB shards
        cur.append(t)
        acc += size(t)
        if acc > 5e8:
            shards.append(cur)
            cur, acc = [], 0
    if cur:
        shards.append(cur)
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        w = SafetensorsWriter(os.path.join(folder, name), [(n, d, s) for n, s, d in shard])
        for n, s, d in shard:
            x = rng.standard_normal(s, np.float32) * 0.02
            w.write(n, x if d == "F32" else x.astype(ml_dtypes.bfloat16))
            weight_map[n] = name
        w.close()
    total = sum(size(t) for t in tensors)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, max(size(t) for t in tensors)


def timed(cmd: list[str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    return wall, rss_kb * 1024, p.stderr


def disk_read_speed(folder: str) -> float:
    """GB/s of a sequential O_DIRECT read of the shards."""
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    total, t0 = 0, time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, check=True)
        total += os.path.getsize(f)
    return total / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.2)
    ap.add_argument("--workdir", default="/tmp/ernie_convert_bench")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    src = os.path.join(args.workdir, "bf16-paddle")
    total, largest = write_checkpoint(src, args.gb)
    bound = 3 * largest + 500e6
    disk = disk_read_speed(src)
    print(f"synthetic checkpoint: {total / 1e9:.2f} GB in {len(os.listdir(src)) - 2} shards, largest tensor "
          f"{largest / 1e6:.0f} MB -> RSS bound {bound / 1e6:.0f} MB; disk sequential read (O_DIRECT) {disk:.2f} GB/s")
    py = sys.executable
    runs = [
        ("paddle_to_jax --dtype bf16", [py, "-m", "converters.paddle_to_jax", "--src", src, "--dst",
                                        os.path.join(args.workdir, "jax-bf16"), "--dtype", "bf16"]),
        ("paddle_to_jax --dtype fp8", [py, "-m", "converters.paddle_to_jax", "--src", src, "--dst",
                                       os.path.join(args.workdir, "jax-fp8"), "--dtype", "fp8"]),
        ("quantize_fp8", [py, "-m", "converters.quantize_fp8", "--src", src, "--dst",
                          os.path.join(args.workdir, "fp8-paddle")]),
    ]
    print("| converter | wall s | read GB/s | peak RSS MB | RSS / bound |")
    print("|---|---|---|---|---|")
    for name, cmd in runs:
        wall, rss, _ = timed(cmd)
        print(f"| {name} | {wall:.1f} | {total / wall / 1e9:.3f} | {rss / 1e6:.0f} | {rss / bound:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
