"""What multi-step decode could save on this machine, before building it: n greedy decode steps as one program
(a `lax.fori_loop` over the engine's own step function, each step's sampled tokens fed to the next on the
device, no host work between steps) against one step per program, and against the engine's chained decode
steps as it runs them (`bench.step_profile.profile`).

    python benchmarks/multistep_probe.py [--streams 1,16] [--steps 8] [--rounds 2]

The loop leaves out what a real multi-step decode needs besides (logprobs per step, stop checks, penalties,
structured-output masks, pages for n tokens ahead), so its time per step is a lower bound: the most such a
feature could take off a step here. Rounds alternate engine, 1-step and n-step programs in one process; ms a
step, medians of 12 runs of the program.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from ernie_jax import LLM
    from ernie_jax.bench.step_profile import profile
    from ernie_jax.engine.step_functions import _step

    counts = [int(x) for x in args.streams.split(",")]
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=max(counts), max_model_len=512)
    programs = llm.engine.instances[-1].programs
    step = functools.partial(_step, cfg=programs.cfg, plan=programs.plan, ex=programs.execution,
                             batch_invariant=False)

    @functools.partial(jax.jit, donate_argnums=(3,), static_argnums=(7,))
    def steps(weights, ids, positions, cache, logit_positions, tables, sampling, n):
        temperature, top_p, top_k, seeds, counters = sampling

        def body(i, carry):
            ids, positions, cache, counters, out = carry
            _, cache, _, sampled = step(weights, ids, positions, cache, logit_positions, tables,
                                        (temperature, top_p, top_k, seeds, counters))
            return sampled[0][:, None].astype(jnp.int32), positions + 1, cache, counters + 1, out.at[i].set(sampled[0])
        out = jnp.zeros((n, ids.shape[0]), jnp.int32)
        _, _, cache, _, out = lax.fori_loop(0, n, body, (ids, positions, cache, counters, out))
        return out, cache

    for streams in counts:
        B = min(b for b in programs.shapes.ready["decode"] if b >= streams)
        rng = np.random.default_rng(0)
        ids = jnp.asarray(rng.integers(3, programs.cfg.vocab_size, (B, 1)), jnp.int32)
        positions = jnp.full((B, 1), 130, jnp.int32)
        logit_positions = jnp.asarray([0] * streams + [-1] * (B - streams), jnp.int32)
        tables = jnp.asarray(np.tile(np.arange(1, programs.max_pages + 1) % programs.num_pages, (B, 1)), jnp.int32)
        sampling = (jnp.zeros(B, jnp.float32), jnp.ones(B, jnp.float32), jnp.zeros(B, jnp.int32),
                    jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32))

        def timed(n: int) -> float:
            out, programs.cache = steps(programs.weights, ids, positions, programs.cache, logit_positions, tables,
                                        sampling, n)
            out.block_until_ready()
            per_step = []
            for _ in range(12):
                t0 = time.perf_counter()
                out, programs.cache = steps(programs.weights, ids, positions, programs.cache, logit_positions,
                                            tables, sampling, n)
                out.block_until_ready()
                per_step.append((time.perf_counter() - t0) / n)
            return 1e3 * statistics.median(per_step)
        for r in range(args.rounds):
            engine = profile(llm, streams, 48, 128)
            one, many = timed(1), timed(args.steps)
            print(f"streams {streams} (B {B}), round {r + 1}: engine's chained steps {1e3 * engine['wall']:.2f} ms a "
                  f"step; one step a program {one:.2f}; {args.steps} steps a program {many:.2f} "
                  f"({many / (1e3 * engine['wall']):.2f}x the engine's)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
