"""GPU kernel benchmark (H100/H200): Pallas block-FP8 matmuls and FP8 paged attention vs XLA.

    PYTHONPATH=. python benchmarks/gpu_kernels.py            # on the GPU machine, under 5 minutes
    PYTHONPATH=. python benchmarks/gpu_kernels.py --smoke    # tiny shapes, any backend (CPU: interpreted)

Matmuls at the 300B shapes (qkv 8192x10240, o 8192x8192, expert up_gate 8192x7168, down 3584x8192) for
M = 1, 64, 256, 4096: TFLOP/s (2MNK / t) and GB/s (FP8 weights + scales + activations + output / t) for
  pallas   the block-FP8 w8a8 kernel (activation quantization inside the kernel) on [K, N] weights,
  pallas-kmajor  the same on K-major [N, K] weights, the layout the loader gives the kernels,
  xla-bf16 a bf16 dot on the dequantized weights (dequantized once, outside the timing),
  xla-fp8  a plain per-tensor e4m3 x e4m3 dot with f32 accumulation (no block scales: a speed anchor),
and as fractions of the H200's 1,979 dense FP8 TFLOP/s and 4.8 TB/s. The grouped kernel runs 8 local
experts of the expert shapes with the rows spread evenly; paged attention reads an FP8 cache (B x context
tokens, 8 KV heads of 128, 64 query heads) and reports the cache bytes read per second; the causal
prefill over the same cache reports TFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ernie_jax import pallas as kernels  # noqa: E402
from ernie_jax.quant import dequantize, quantize_block_fp8  # noqa: E402

PEAK_FLOPS, PEAK_BW = 1979e12, 4.8e12
SHAPES = {"qkv": (8192, 10240), "o": (8192, 8192), "expert_up_gate": (8192, 7168), "expert_down": (3584, 8192)}


def timeit(fn, *args, reps: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def row(name, M, K, N, impl, t, nbytes):
    flops = 2 * M * K * N / t
    print(f"| {name} | {M} | {impl} | {t * 1e6:.1f} | {flops / 1e12:.1f} | {nbytes / t / 1e9:.0f} | "
          f"{100 * flops / PEAK_FLOPS:.1f}% | {100 * nbytes / t / PEAK_BW:.1f}% |", flush=True)


def matmuls(ms, shapes, reps):
    print("| shape (K x N) | M | impl | us | TFLOP/s | GB/s | % FP8 peak | % HBM BW |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (K, N) in shapes.items():
        w = quantize_block_fp8(jax.random.normal(jax.random.key(0), (K, N), jnp.float32) * 0.02)
        wt = w.relayout(True)
        wt = jax.tree.map(lambda a: jnp.array(a, copy=True), wt)  # a K-major buffer, not a transposed view
        w_bf16 = dequantize(w, jnp.bfloat16)
        w_nbytes = w.values.nbytes + w.scales.nbytes
        for M in ms:
            x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(jnp.bfloat16)
            io = x.nbytes + M * N * 2
            for impl, wl in (("pallas", w), ("pallas-kmajor", wt)):
                pallas = jax.jit(lambda x, q, s, _k=wl.k_major: kernels.block_fp8_matmul(
                    x, q, s, implementation="pallas", k_major=_k))
                row(f"{name} {K}x{N}", M, K, N, impl, timeit(pallas, x, wl.values, wl.scales, reps=reps),
                    w_nbytes + io)
            bf16 = jax.jit(lambda x, wb: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            row(f"{name} {K}x{N}", M, K, N, "xla-bf16", timeit(bf16, x, w_bf16, reps=reps), w_bf16.nbytes + io)
            fp8 = jax.jit(lambda x, q: jnp.dot(x.astype(jnp.float8_e4m3fn), q, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16))
            row(f"{name} {K}x{N}", M, K, N, "xla-fp8", timeit(fp8, x, w.values, reps=reps), w.values.nbytes + io)


def grouped(ms, reps, K=8192, N=7168, G=8):
    print("\n| grouped (8 experts) K x N | M | impl | us | TFLOP/s | GB/s | % FP8 peak | % HBM BW |")
    print("|---|---|---|---|---|---|---|---|")
    w = quantize_block_fp8(jax.random.normal(jax.random.key(0), (G, K, N), jnp.float32) * 0.02)
    wt = jax.tree.map(lambda a: jnp.array(a, copy=True), w.relayout(True))
    for M in ms:
        x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(jnp.bfloat16)
        sizes = jnp.full((G,), M // G, jnp.int32).at[0].add(M - G * (M // G))
        nbytes = w.values.nbytes + w.scales.nbytes + x.nbytes + M * N * 2
        for impl, wl in (("pallas", w), ("pallas-kmajor", wt)):
            fn = jax.jit(lambda x, q, s, g, _k=wl.k_major: kernels.grouped_block_fp8_matmul(
                x, q, s, g, implementation="pallas", k_major=_k))
            row(f"{K}x{N}", M, K, N, impl, timeit(fn, x, wl.values, wl.scales, sizes, reps=reps), nbytes)


def attention(batches, context, reps, page=16, K=8, D=128, N=64):
    print("\n| paged decode attention (fp8 KV) | batch | context | us | cache GB/s | % HBM BW |")
    print("|---|---|---|---|---|---|")
    for B in batches:
        pages_per_seq = context // page
        P = B * pages_per_seq + 1
        kv = jax.random.normal(jax.random.key(0), (P, page, K, D), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jnp.full((P, page, K), 0.01, jnp.float32)
        q = jax.random.normal(jax.random.key(1), (B, N, D), jnp.float32).astype(jnp.bfloat16)
        tables = (1 + jnp.arange(B * pages_per_seq, dtype=jnp.int32)).reshape(B, pages_per_seq)
        lengths = jnp.full((B,), context, jnp.int32)
        fn = jax.jit(lambda *a: kernels.paged_decode_attention(*a, implementation="pallas"))
        t = timeit(fn, q, kv, kv, scale, scale, tables, lengths, reps=reps)
        read = 2 * B * context * K * (D + 4)
        print(f"| pallas | {B} | {context} | {t * 1e6:.1f} | {read / t / 1e9:.0f} | {100 * read / t / PEAK_BW:.1f}% |",
              flush=True)


def prefill_attention(chunks, reps, page=16, K=8, D=128, N=64):
    print("\n| paged prefill attention (fp8 KV, causal chunk from position 0) | tokens | us | TFLOP/s | % FP8 peak |")
    print("|---|---|---|---|---|")
    for T in chunks:
        P = T // page + 1
        kv = jax.random.normal(jax.random.key(0), (P, page, K, D), jnp.float32).astype(jnp.float8_e4m3fn)
        scale = jnp.full((P, page, K), 0.01, jnp.float32)
        q = jax.random.normal(jax.random.key(1), (1, T, N, D), jnp.float32).astype(jnp.bfloat16)
        tables = (1 + jnp.arange(T // page, dtype=jnp.int32))[None]
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        fn = jax.jit(lambda *a: kernels.paged_attention(*a, implementation="pallas"))
        t = timeit(fn, q, kv, kv, scale, scale, tables, positions, reps=reps)
        flops = 2 * 2 * N * D * T * T / 2  # causal: half of QK^T and PV
        print(f"| pallas | {T} | {t * 1e6:.1f} | {flops / t / 1e12:.1f} | {100 * flops / t / PEAK_FLOPS:.1f}% |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs interpreted on a CPU)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"{datetime.date.today()} | {dev.device_kind} ({dev.platform}) | JAX {jax.__version__}\n")
    if args.smoke:
        matmuls([1, 16], {"small": (256, 256)}, reps=2)
        grouped([16], reps=2, K=256, N=256, G=2)
        attention([2], 64, reps=2)
        prefill_attention([32], reps=2)
        return 0
    matmuls([1, 64, 256, 4096], SHAPES, reps=20)
    grouped([64, 256, 4096], reps=20)
    attention([8, 32], 4096, reps=20)
    prefill_attention([1024, 4096], reps=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
