"""Which weight dtype XLA:CPU multiplies fastest on this CPU: f32 weights, BF16 weights with the activations
cast to BF16 and f32 accumulation, and BF16 in and out, for decode- and prefill-sized matmuls.

    python benchmarks/cpu_matmul_dtypes.py [--shapes 2x256x8192,16x512x8192]

Prints microseconds per call (median of 5 rounds of --calls calls) and the CPU's vector extensions, so the
figures of machines with and without AVX-512 BF16 can be set side by side (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ernie_jax.ops.block_fp8_matmul.xla_cpu import cpu_flags, vector_extensions  # noqa: E402

SHAPES = "2x256x8192,16x256x8192,2x256x1536,16x512x8192,2x1024x4096"


def per_call_us(f, *args, calls: int) -> float:
    jax.block_until_ready(f(*args))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(rounds))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="MxKxN,...")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    f32 = jax.jit(lambda x, w: x @ w)
    bf16_weights = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    bf16_all = jax.jit(lambda x, w: jnp.dot(x, w))
    rng = np.random.default_rng(0)
    print(f"CPU vector extensions: {(vector_extensions() or 'no AVX2') if cpu_flags() else 'unknown'}")
    print("| M x K x N | f32 us | BF16 weights, f32 accumulation us | BF16 in and out us |")
    print("|---|---|---|---|")
    for shape in args.shapes.split(","):
        M, K, N = (int(v) for v in shape.split("x"))
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
        wb = w.astype(jnp.bfloat16)
        print(f"| {M} x {K} x {N} | {per_call_us(f32, x, w, calls=args.calls):.1f} | "
              f"{per_call_us(bf16_weights, x, wb, calls=args.calls):.1f} | "
              f"{per_call_us(bf16_all, x.astype(jnp.bfloat16), wb, calls=args.calls):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
