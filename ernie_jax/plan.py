"""Memory plan: compile the engine's own paged prefill and decode programs of a config from abstract shapes.

    python -m ernie_jax.plan --model ernie-4.5-300b-a47b --quantization fp8|wint8|wint4|w4a8 --mesh 8 \\
        [--prefill-devices 4 --decode-devices 4] [--max-num-seqs 32 --max-model-len 32768] [--json]

Nothing is allocated: weights (the MTP block included), the KV page pool and inputs are ShapeDtypeStructs
carrying their shardings, on as many fake CPU devices as the mesh needs (set up before JAX starts). The
programs are engine.step_functions.step_program, lowered by lower_step exactly as ModelPrograms lowers its
buckets, with the execution config a GPU selects without kernels (the Pallas kernels are not
partitioned by XLA:CPU): prefill = one chunk of `--prefill-tokens` tokens, decode = one token for each of
`--max-num-seqs` sequences (with `--speculative-config`, the MTP programs: prefill drafting after the
chunk, decode verifying k drafts, k + 1 tokens per sequence), over the pools the engine allocates where
devices report no memory limit (max_num_seqs x pages per sequence; under PD each submesh's pool that
size; on GPUs the engine sizes its pools from memory instead, which is what "KV tokens that fit"
estimates). Per device it reports weights and KV bytes (exact, from the shardings), temporaries (XLA:CPU's
figure, shown but not trusted: XLA:CPU upcasts bf16 dot operands and decomposes ragged_dot densely, so its
temporaries do not predict a GPU's, docs/xla-notes.md N6), XLA's FLOP estimate for one device's program, the
compile time, and how many tokens of KV fit per submesh on an H200 (141 GB) and an H100 (80 GB) once the
weights are resident, at vLLM's default 0.9 memory utilisation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ernie_jax.config import QUANTIZATION_SCHEMES

GPUS = {"H200": 141e9, "H100": 80e9}
UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


def plan_program(cfg, devices, mesh_spec, *, quantization, kv_cache_dtype, batch, tokens, num_pages, page_size,
                 max_pages, rules="tp_ep", kind="step", k=0, group=-1) -> dict:
    """kind: step_program's ("step", or "spec_prefill" / "verify" with k MTP drafts: the pool then holds the
    MTP block's KV, and a verify step is `tokens` = k + 1 per sequence)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from ernie_jax.engine.step_functions import lower_step, step_program
    from ernie_jax.model.forward import rope_cache
    from ernie_jax.model.kv_cache import KV_CACHE_DTYPES, KVCache
    from ernie_jax.model.weights import abstract_weights
    from ernie_jax.ops import ExecutionConfig, Platform
    from ernie_jax.sharding import ShardingPlan, abstract_device_bytes, make_mesh
    from ernie_jax.sharding.fused import fit_plan

    plan = ShardingPlan.create(make_mesh(mesh_spec, devices), rules)
    ex = ExecutionConfig.select(Platform("gpu", (9, 0)), "xla")
    replicated = NamedSharding(plan.mesh, P())
    weights = abstract_weights(cfg, jnp.bfloat16, quantization, group)
    plan = fit_plan(plan, cfg, weights)  # as serving places them (ErnieForCausalLM.from_host)
    w_shard = plan.shardings(weights)
    weights = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), weights, w_shard)
    w_bytes = abstract_device_bytes(weights, w_shard)  # the MTP block included: it is resident
    if not k:
        weights.pop("mtp", None)  # only the speculative programs read it
    rope = jax.eval_shape(lambda: rope_cache(cfg, page_size * max_pages))
    weights["rope_cache"] = jax.ShapeDtypeStruct(rope.shape, rope.dtype, sharding=replicated)
    cache = jax.eval_shape(lambda: KVCache.create(cfg, num_pages, page_size, KV_CACHE_DTYPES[kv_cache_dtype], k > 0))
    c_shard = cache.shardings(plan)
    cache = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), cache, c_shard)
    t0 = time.perf_counter()
    jitted = step_program(cfg, plan, ex, jax.tree.map(lambda a: a.sharding, weights), c_shard, replicated,
                          kind=kind, k=k)
    extra = ((batch,),) if k else ()  # next_tokens / max_accept
    compiled = lower_step(jitted, weights, cache, replicated, batch, tokens, max_pages, extra, sampling=True).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    kv_bytes = abstract_device_bytes(cache, c_shard)
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else 0
    per_token = kv_bytes / (num_pages * page_size)
    return {"devices": len(plan.mesh.devices.flat), "mesh": dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape)),
            "batch": batch, "tokens": tokens, "kv_pages": num_pages, "page_size": page_size,
            "weights_bytes": w_bytes, "kv_cache_bytes": kv_bytes, "temp_bytes": temp,
            "resident_bytes": w_bytes + kv_bytes, "kv_bytes_per_token": per_token,
            "compile_seconds": round(seconds, 2), "execution": ex.describe(),
            "flops": float(cost.get("flops", 0.0)),  # XLA's estimate for one device's program
            "kv_tokens_fit": {gpu: max(0, int((UTILIZATION * cap - w_bytes) // per_token)) for gpu, cap in GPUS.items()},
            "fits": {gpu: w_bytes + kv_bytes <= UTILIZATION * cap for gpu, cap in GPUS.items()}}


def axes_across_hosts(mesh_spec, hosts: int) -> list[str]:
    """The mesh axes along which devices of different hosts meet, with the devices numbered host by host in
    mesh order (as jax.devices() lists them under jax.distributed)."""
    import numpy as np

    from ernie_jax.sharding.mesh import AXES, parse_mesh_spec
    sizes = parse_mesh_spec(mesh_spec)
    n = int(np.prod(list(sizes.values())))
    host = (np.arange(n) // (n // hosts)).reshape([sizes[a] for a in AXES])
    return [a for i, a in enumerate(AXES) if (np.diff(host, axis=i) != 0).any()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ernie-4.5-300b-a47b", help="preset name or checkpoint folder")
    ap.add_argument("--quantization", choices=list(QUANTIZATION_SCHEMES), default=None,
                    help="weights as `serve --quantization` makes them (default: bf16)")
    ap.add_argument("--quant-group-size", type=int, default=-1, help="wint4's scale groups (-1: per channel)")
    ap.add_argument("--kv-cache-dtype", choices=["bfloat16", "fp8"], default="bfloat16")
    ap.add_argument("--mesh", default="8", help="device count or 'data=..,expert=..,tensor=..'")
    ap.add_argument("--prefill-devices", type=int, default=None)
    ap.add_argument("--decode-devices", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--prefill-tokens", type=int, default=None, help="default: min(max-model-len, 8192)")
    ap.add_argument("--sharding", default="tp_ep", help="rules preset")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--speculative-config", default=None, metavar="JSON",
                    help='MTP speculative decoding, as the server takes it: the speculative programs (prefill '
                         'with MTP drafts; decode verifying k drafts, k + 1 tokens per sequence)')
    ap.add_argument("--num-processes", type=int, default=1,
                    help="hosts the mesh spans (one process each, as `serve --num-processes`): the plan says which "
                         "mesh axes cross hosts (their collectives go over the network)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from ernie_jax.sharding.mesh import MeshError, request_host_devices
    try:
        n = request_host_devices(args.mesh)  # before JAX creates its backends: plans compile on host devices
    except MeshError as e:
        ap.error(f"--mesh: {e}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    disagg = args.prefill_devices is not None or args.decode_devices is not None
    p_dev = args.prefill_devices if disagg else n
    d_dev = args.decode_devices if args.decode_devices is not None else (n - p_dev if disagg else n)
    if disagg and (p_dev < 1 or d_dev < 1 or p_dev + d_dev > n):
        ap.error(f"--prefill-devices {p_dev} + --decode-devices {d_dev} must be >= 1 each and fit --mesh {n}")
    from ernie_jax.engine.speculative import SpeculativeConfig
    try:
        spec = SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:
        ap.error(f"--speculative-config: {e}")
    k = spec.num_speculative_tokens if spec else 0
    import jax

    from ernie_jax.config import PRESETS, ErnieConfig
    cfg = ErnieConfig.preset(args.model) if args.model.lower() in PRESETS else ErnieConfig.from_pretrained(args.model)
    if k and not cfg.has_mtp:
        ap.error(f"--speculative-config: {args.model} has no MTP block (num_nextn_predict_layers = 0)")
    devices = jax.devices()[:n]
    prefill_tokens = args.prefill_tokens or min(args.max_model_len, 8192)
    page = args.block_size
    from ernie_jax.engine.shapes import table_pages
    decode_pool = args.max_num_seqs * table_pages(args.max_model_len, page) + 1  # the Engine's rule (no memory limit)
    common = dict(quantization=args.quantization, group=args.quant_group_size, kv_cache_dtype=args.kv_cache_dtype,
                  rules=args.sharding,
                  page_size=page, max_pages=table_pages(args.max_model_len, page, k), k=k)
    prefill_devs = devices[:p_dev]
    decode_devs = devices[p_dev:p_dev + d_dev] if disagg else devices
    prefill_pool = decode_pool  # each PD submesh's pool is sized by the same rule
    if n % args.num_processes or (disagg and args.num_processes > 1):
        ap.error(f"--num-processes {args.num_processes}: the {n} devices must split evenly, and an instance across "
                 "processes is colocated (no --prefill-devices / --decode-devices)")
    report = {"model": args.model, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "disaggregated": disagg, "num_processes": args.num_processes,
              "axes_across_hosts": axes_across_hosts(args.mesh, args.num_processes),
              "speculative_tokens": k,
              "prefill": plan_program(cfg, prefill_devs, len(prefill_devs) if disagg else args.mesh, batch=1,
                                      tokens=prefill_tokens, num_pages=prefill_pool,
                                      kind="spec_prefill" if k else "step", **common),
              "decode": plan_program(cfg, decode_devs, len(decode_devs) if disagg else args.mesh,
                                     batch=args.max_num_seqs, tokens=k + 1, num_pages=decode_pool,
                                     kind="verify" if k else "step", **common)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    scheme = args.quantization or "bf16"
    scheme += f" (groups of {args.quant_group_size})" if args.quant_group_size != -1 else ""
    print(f"{args.model} ({scheme} weights, {args.kv_cache_dtype} KV), "
          f"{'disaggregated' if disagg else 'colocated'} on {n} devices"
          f"{f', MTP with {k} draft tokens' if k else ''}; ops: {report['decode']['execution']}")
    if args.num_processes > 1:
        across = report["axes_across_hosts"]
        print(f"{args.num_processes} hosts x {n // args.num_processes} devices; mesh axes across hosts: "
              f"{', '.join(across) or 'none'} (their collectives cross the network), the others within a host")
    print("| program | devices | weights GB | KV pool GB | weights+KV GB | temp GB (XLA:CPU) | GFLOP (XLA) | "
          "compile s | KV tokens that fit, H200 | H100 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("prefill", "decode"):
        r = report[name]
        fit = r["kv_tokens_fit"]
        print(f"| {name} ({r['batch']} x {r['tokens']} tok, {r['kv_pages']} pages) | {r['devices']} | "
              f"{r['weights_bytes'] / 1e9:.2f} | {r['kv_cache_bytes'] / 1e9:.2f} | {r['resident_bytes'] / 1e9:.2f} | "
              f"{r['temp_bytes'] / 1e9:.2f} | {r['flops'] / 1e9:,.0f} | {r['compile_seconds']} | {fit['H200']:,} | "
              f"{fit['H100']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
