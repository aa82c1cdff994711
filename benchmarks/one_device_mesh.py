"""A one-device mesh against the unsharded engine, alternated in one process (issue: a one-device mesh
must run at the unsharded path's speed).

    PYTHONPATH=. python benchmarks/one_device_mesh.py [--model bench-512] [--repeats 3]

Both engines serve the same random weights; each run submits 16 prompts x 128 new tokens (greedy,
ignore_eos) at once and reports output tokens/s; runs alternate mesh / unsharded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    import numpy as np

    from ernie_jax import LLM, SamplingParams
    base = LLM(args.model, max_num_seqs=args.num_prompts, max_model_len=512, max_num_batched_tokens=2048)
    mesh = LLM(base.model, mesh=1, disaggregate=False, max_num_seqs=args.num_prompts, max_model_len=512,
               max_num_batched_tokens=2048)
    assert mesh.model.plan is None, "a one-device mesh should place the model unsharded"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, base.model.config.vocab_size, 128).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates = {"unsharded": [], "mesh=1": []}
    for llm in (base, mesh):  # warm-up
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    for _ in range(args.repeats):
        for name, llm in (("mesh=1", mesh), ("unsharded", base)):
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=sp)
            rates[name].append(args.num_prompts * args.output_len / (time.perf_counter() - t0))
    for name, r in rates.items():
        print(f"{name}: {np.median(r):.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in r)})")
    print(f"ratio mesh=1 / unsharded: {np.median(rates['mesh=1']) / np.median(rates['unsharded']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
