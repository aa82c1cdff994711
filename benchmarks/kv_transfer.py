"""KV page transfer time between the prefill and decode submeshes (PD disaggregation), per MB and per prompt.

    python benchmarks/kv_transfer.py [--model bench-512] [--mesh 8] [--prefill-devices 4]
                                     [--num-prompts 8] [--prompt-len 1000] [--dtype bfloat16]

Without GPUs the mesh is made of fake CPU devices (set here before JAX starts). A warm-up batch compiles the
transfer's page-count bucket; the timed batch then prefills every prompt on the prefill submesh, and each
prompt's pages move once (gather, one `jax.device_put`, donated scatter: engine/programs.py PageTransfer).
Reported: the bytes moved (as the pool stores them), the seconds (waited for each scatter), ms/MB and ms
per prompt.
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
    args = ap.parse_args()
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.mesh}").strip()
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


if __name__ == "__main__":
    main()
