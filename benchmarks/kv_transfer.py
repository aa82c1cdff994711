"""KV page transfer time between the prefill and decode submeshes (PD disaggregation), per MB and per prompt.

    python benchmarks/kv_transfer.py [--model bench-512] [--mesh 8] [--prefill-devices 4]
                                     [--num-prompts 8] [--prompt-len 1000] [--dtype bfloat16]

Without GPUs the mesh is made of fake CPU devices (set here before JAX starts). A warm-up batch compiles the
transfer's page-count bucket; the timed batch then prefills every prompt on the prefill submesh, and each
prompt's pages move once (gather, one `jax.device_put`, donated scatter: engine/programs.py PageTransfer).
Reported: the bytes moved (as the pool stores them), the seconds (waited for each scatter), ms/MB and ms
per prompt.

    python benchmarks/kv_transfer.py --between-transfer-servers [--model bench-512] [--mesh 4]

The path between server processes instead (engine/kv_connector.py), its two forms side by side: a pool on
the first half of the devices exports a prompt's pages, a pool laid out alike on the other half pulls them
through `jax.experimental.transfer` (two transfer servers in this process, on loopback) shard by shard, or
through one device (copied there by the exporter, resharded on arrival), alternated, 5 pulls each per prompt
length; no engine, the pools hold random values. Reported per prompt length: MB, medians of export, offer +
pull, and scatter ms for each form.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-512")
    ap.add_argument("--mesh", type=int, default=8)
    ap.add_argument("--prefill-devices", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--between-transfer-servers", action="store_true",
                    help="time the KV path between server processes, shard by shard and through one device")
    args = ap.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.mesh}").strip()
    if args.between_transfer_servers:
        return between_transfer_servers(args)
    import numpy as np

    from ernie_jax import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, mesh=args.mesh, prefill_devices=args.prefill_devices,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.prompt_len + 8, max_num_seqs=4,
              max_num_batched_tokens=args.prompt_len, pd_policy="static")  # static: every prompt moves
    vocab = llm.model.config.vocab_size
    prompts = np.random.default_rng(0).integers(3, vocab, (args.num_prompts + 2, args.prompt_len)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=sp)  # compiles the transfer's bucket
    transfer = llm.engine.instance("prefill").transfer
    transfer.seconds, transfer.bytes = 0.0, 0
    llm.generate(prompt_token_ids=prompts[2:], sampling_params=sp)
    mb = transfer.bytes / 1e6
    pool = llm.engine.instance("decode").programs.cache.k[0].dtype
    print(f"{args.num_prompts} prompts x {args.prompt_len} tokens, pool {pool}: {mb:.2f} MB in "
          f"{transfer.seconds:.3f} s, {transfer.seconds * 1e3 / mb:.2f} ms/MB, "
          f"{transfer.seconds * 1e3 / args.num_prompts:.1f} ms per prompt")


def between_transfer_servers(args) -> None:
    import statistics
    import time
    import types

    import jax
    import numpy as np
    from flax import nnx

    from ernie_jax import ErnieConfig, ErnieForCausalLM
    from ernie_jax.engine.config import CacheConfig
    from ernie_jax.engine.kv_connector import KVExporter, KVImporter
    from ernie_jax.engine.programs import ModelPrograms
    from ernie_jax.sharding import ShardingPlan, make_mesh

    cfg = ErnieConfig.preset(args.model)
    model = ErnieForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=getattr(jax.numpy, args.dtype))
    half = args.mesh // 2
    mesh = f"data=1,expert=1,tensor={half}"
    page, max_pages = 16, -(-args.prompt_len // 16)

    def pool(devices):
        return ModelPrograms(model.shard(ShardingPlan.create(make_mesh(mesh, devices))), "x",
                             CacheConfig(block_size=page, num_gpu_blocks_override=max_pages + 1,
                                         kv_cache_dtype=args.kv_cache_dtype),
                             max_pages_per_seq=max_pages, prefill_buckets=[], decode_buckets=[], startup_kinds=())
    src, dst = pool(jax.devices()[:half]), pool(jax.devices()[half:2 * half])
    rng = np.random.default_rng(0)
    src.cache = jax.tree.map(lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s),
                             src.cache, src.cache_shardings)
    exporter, importer = KVExporter(src), KVImporter(dst)
    if exporter.layout.shards != importer.layout.shards or not exporter.layout.shards:
        raise SystemExit(f"{args.model} on {mesh}: the pool holds replicas, so it never crosses shard by shard")
    print(f"{args.model}, pools on {half} + {half} CPU devices ({mesh}), KV {src.cache.k[0].dtype}, "
          f"{page}-token pages; medians of 5, ms")
    print("| prompt tokens | KV MB | path | export | offer + pull | scatter |")
    print("|---|---|---|---|---|---|")
    for tokens in (128, 512, args.prompt_len):
        pages = list(range(1, -(-tokens // page) + 1))
        times = {True: [], False: []}
        for rep in range(6):
            for sharded in (True, False):
                req = types.SimpleNamespace(request_id="r", output_ids=[1], logprobs=[], drafts=None,
                                            prompt_ids=[1] * tokens)
                t0 = time.perf_counter()
                exporter.export(req, pages)
                jax.block_until_ready(jax.tree.leaves(exporter._exports["r"].batch))
                t1 = time.perf_counter()
                batch = importer.pull(exporter.offer("r", 0, importer.layout.shards if sharded else ""))
                t2 = time.perf_counter()
                importer.scatter(batch, pages)
                jax.block_until_ready(dst.cache)
                t3 = time.perf_counter()
                if rep:  # the first of each compiles the gather, the copy and the scatter for this size
                    times[sharded].append((t1 - t0, t2 - t1, t3 - t2))
        mb = sum(a.nbytes for a in jax.tree.leaves(batch)) / 1e6
        for sharded in (True, False):
            med = [statistics.median(x[i] for x in times[sharded]) * 1e3 for i in range(3)]
            print(f"| {tokens} | {mb:.2f} | {'shard by shard' if sharded else 'one device'} | {med[0]:.2f} | "
                  f"{med[1]:.2f} | {med[2]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
