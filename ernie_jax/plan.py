"""Memory plan: compile the real prefill and decode programs of a config from abstract shapes.

    python -m ernie_jax.plan --model ernie-4.5-300b-a47b --quantization fp8 --mesh 8 \\
        [--prefill-devices 4 --decode-devices 4] [--max-num-seqs 32 --max-model-len 32768] [--json]

Nothing is allocated: weights, KV cache and inputs are ShapeDtypeStructs carrying their shardings, on as
many fake CPU devices as the mesh needs (set up before JAX starts). For each program it reports per-device
bytes of weights and KV cache (exact, from the shardings), temporaries (XLA:CPU's figure, shown but not
trusted: XLA:CPU upcasts bf16 dot operands and decomposes ragged_dot densely, so its temporaries do not
predict a GPU's, ANCHORS P10), the compile time, and whether weights + KV fit an H200 (141 GB) and an
H100 (80 GB).
Programs: prefill = one sequence of `--prefill-tokens` tokens written into its KV cache; decode = one
token for each of `--max-num-seqs` sequences over caches of `--max-model-len` slots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GPUS = {"H200": 141e9, "H100": 80e9}


def _setup_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def plan_program(cfg, devices, mesh_spec, *, quantization, kv_cache_dtype, batch, tokens, cache_len,
                 rules="tp_ep") -> dict:
    import jax
    import jax.numpy as jnp

    from ernie_jax.model.forward import forward_cached_jit
    from ernie_jax.model.kv_cache import KV_CACHE_DTYPES, KVCache
    from ernie_jax.model.weights import abstract_weights
    from ernie_jax.sharding import ShardingPlan, abstract_device_bytes, make_mesh

    plan = ShardingPlan.create(make_mesh(mesh_spec, devices), rules)
    weights = abstract_weights(cfg, jnp.bfloat16, quantization)
    weights.pop("mtp", None)  # the MTP block is a separate (speculative) program
    w_shard = plan.shardings(weights)
    weights = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), weights, w_shard)
    cache = jax.eval_shape(lambda: KVCache.create(cfg, batch, cache_len, KV_CACHE_DTYPES[kv_cache_dtype]))
    c_shard = cache.shardings(plan)
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, c_shard)
    batch_sharding = plan.activation(("batch", None), (batch, tokens))
    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=batch_sharding)
    logit_pos = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=plan.activation(("batch",), (batch,)))
    t0 = time.perf_counter()
    lowered = forward_cached_jit.trace(weights, cfg, ids, ids, cache, logit_pos, plan).lower()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    w_bytes = abstract_device_bytes(weights, w_shard)
    kv_bytes = abstract_device_bytes(cache, c_shard)
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    resident = w_bytes + kv_bytes
    return {"devices": len(plan.mesh.devices.flat), "mesh": dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape)),
            "batch": batch, "tokens": tokens, "cache_len": cache_len, "weights_bytes": w_bytes,
            "kv_cache_bytes": kv_bytes, "temp_bytes": temp, "resident_bytes": resident,
            "compile_seconds": round(seconds, 2),
            # Weights + KV are exact; XLA:CPU's temporaries are shown but do not decide the verdict.
            "fits": {gpu: resident <= cap for gpu, cap in GPUS.items()},
            "fits_with_cpu_temp": {gpu: resident + temp <= cap for gpu, cap in GPUS.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ernie-4.5-300b-a47b", help="preset name or checkpoint folder")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["bfloat16", "fp8"], default="bfloat16")
    ap.add_argument("--mesh", default="8", help="device count or 'data=..,expert=..,tensor=..'")
    ap.add_argument("--prefill-devices", type=int, default=None)
    ap.add_argument("--decode-devices", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--prefill-tokens", type=int, default=None, help="default: min(max-model-len, 8192)")
    ap.add_argument("--sharding", default="tp_ep", help="rules preset")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    # JAX must not start before the fake devices are configured, so the spec is read here by hand
    # (make_mesh validates it properly below).
    n = 1
    for part in str(args.mesh).split(","):
        n *= int(part.rpartition("=")[2])
    disagg = args.prefill_devices is not None or args.decode_devices is not None
    p_dev = args.prefill_devices if disagg else n
    d_dev = args.decode_devices if args.decode_devices is not None else (n - p_dev if disagg else n)
    if disagg and (p_dev < 1 or d_dev < 1 or p_dev + d_dev > n):
        ap.error(f"--prefill-devices {p_dev} + --decode-devices {d_dev} must be >= 1 each and fit --mesh {n}")
    _setup_devices(n)
    import jax

    from ernie_jax.config import PRESETS, ErnieConfig
    cfg = ErnieConfig.preset(args.model) if args.model.lower() in PRESETS else ErnieConfig.from_pretrained(args.model)
    devices = jax.devices()[:n]
    prefill_tokens = args.prefill_tokens or min(args.max_model_len, 8192)
    common = dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, rules=args.sharding)
    prefill_devs = devices[:p_dev]
    decode_devs = devices[p_dev:p_dev + d_dev] if disagg else devices
    report = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "disaggregated": disagg,
              "prefill": plan_program(cfg, prefill_devs, len(prefill_devs) if disagg else args.mesh, batch=1,
                                      tokens=prefill_tokens, cache_len=args.max_model_len, **common),
              "decode": plan_program(cfg, decode_devs, len(decode_devs) if disagg else args.mesh,
                                     batch=args.max_num_seqs, tokens=1, cache_len=args.max_model_len, **common)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model} ({args.quantization or 'bf16'} weights, {args.kv_cache_dtype} KV), "
          f"{'disaggregated' if disagg else 'colocated'} on {n} devices")
    print("| program | devices | weights GB | KV GB | weights+KV GB | temp GB (XLA:CPU) | compile s | H200 | H100 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("prefill", "decode"):
        r = report[name]
        print(f"| {name} (batch {r['batch']} x {r['tokens']} tok, cache {r['cache_len']}) | {r['devices']} | "
              f"{r['weights_bytes'] / 1e9:.2f} | {r['kv_cache_bytes'] / 1e9:.2f} | {r['resident_bytes'] / 1e9:.2f} | "
              f"{r['temp_bytes'] / 1e9:.2f} | {r['compile_seconds']} | {'fits' if r['fits']['H200'] else 'NO'} | "
              f"{'fits' if r['fits']['H100'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
