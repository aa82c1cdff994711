"""The GPU check (H100/H200), one command in under 5 minutes: kernels against their references, kernel
timings at 300B shapes, and a random-weight 21B-A3B end to end.

    PYTHONPATH=. python benchmarks/gpu_check.py            # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke    # tiny shapes, any backend (CPU: interpreted)

1. Correctness: the execution config this device selects (ops/execution.py, with its start-up self-check),
   then every Pallas kernel, un-interpreted, against its XLA reference on small and 300B-sized shapes
   (max relative error; FAIL beyond 2e-2).
2. Timings.
Matmuls at the 300B shapes (qkv 8192x10240, o 8192x8192, expert up_gate 8192x7168, down 3584x8192) for
M = 1, 64, 256, 4096: TFLOP/s (2MNK / t) and GB/s (FP8 weights + scales + activations + output / t) for
  pallas   the block-FP8 w8a8 kernel (activation quantization inside the kernel) on [K, N] weights,
  pallas-kmajor  the same on K-major [N, K] weights, the layout the loader gives the kernels,
  xla-bf16 a bf16 dot on the dequantized weights (dequantized once, outside the timing),
  xla-fp8  a plain per-tensor e4m3 x e4m3 dot with f32 accumulation (no block scales: a speed anchor),
   and as fractions of the H200's 1,979 dense FP8 TFLOP/s and 4.8 TB/s; the integer-weight kernel (wint8,
   wint4 in groups of 128, W4A8) against its XLA reference at decode and prefill M. The grouped kernel runs 8 local
   experts of the expert shapes with the rows spread evenly, and once with 1/8 of its buffer routed (the
   tiles past the rows are skipped); paged attention reads an FP8 cache (B x context tokens, 8 KV heads of
   128, 64 query heads) and reports the cache bytes read per second; the causal prefill over the same
   cache reports TFLOP/s.
3. End to end: ERNIE-4.5-21B-A3B with random bf16 weights drawn on the device, through LLM(...), greedy
   decode tok/s at batch 1 and 32 against the HBM roofline (active weights + KV read once per step), and where
   a decode step goes at each batch (bench.step_profile). It runs first: a lent GPU's time is short.
A GPU machine without llguidance (a dependency of the engine) needs it and its .dist-info on PYTHONPATH.
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

from ernie_jax.ops.base import Platform  # noqa: E402
from ernie_jax.ops.block_fp8_matmul import block_fp8_matmul  # noqa: E402
from ernie_jax.ops.grouped_fp8_matmul import grouped_fp8_matmul  # noqa: E402
from ernie_jax.ops.grouped_int_matmul import grouped_int_matmul  # noqa: E402
from ernie_jax.ops.int_weight_matmul import int_weight_matmul  # noqa: E402
from ernie_jax.ops.paged_attention import paged_attention  # noqa: E402
from ernie_jax.ops.selfcheck import execution_for  # noqa: E402
from ernie_jax.quant import dequantize, quantize_block_fp8, quantize_int  # noqa: E402

KERNEL = "pallas_triton"
# Every kernel call names the device's platform: without it a kernel would run in the Pallas interpreter.
ON = dict(implementation=KERNEL, platform=Platform.of(jax.devices()[0]))

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
                pallas = jax.jit(lambda x, q, s, _k=wl.k_major: block_fp8_matmul(x, q, s, _k, **ON))
                row(f"{name} {K}x{N}", M, K, N, impl, timeit(pallas, x, wl.values, wl.scales, reps=reps),
                    w_nbytes + io)
            bf16 = jax.jit(lambda x, wb: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            row(f"{name} {K}x{N}", M, K, N, "xla-bf16", timeit(bf16, x, w_bf16, reps=reps), w_bf16.nbytes + io)
            fp8 = jax.jit(lambda x, q: jnp.dot(x.astype(jnp.float8_e4m3fn), q, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16))
            row(f"{name} {K}x{N}", M, K, N, "xla-fp8", timeit(fp8, x, w.values, reps=reps), w.values.nbytes + io)


INT_SCHEMES = {"wint8": (8, -1, "weight_only"), "wint4 g128": (4, 128, "weight_only"), "w4a8": (4, -1, "w4a8")}


def int_matmuls(ms, shapes, reps):
    print("\n| integer weights (K x N) | M | impl | us | TFLOP/s | GB/s | % FP8 peak | % HBM BW |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (K, N) in shapes.items():
        host = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) * 0.02
        for scheme, fmt in INT_SCHEMES.items():
            w = jax.device_put(quantize_int(host, *fmt))
            for M in ms:
                x = jax.random.normal(jax.random.key(1), (M, K), jnp.float32).astype(jnp.bfloat16)
                nbytes = w.nbytes + x.nbytes + M * N * 2
                for impl in (KERNEL, "xla"):
                    fn = jax.jit(lambda x, w, _i=impl: int_weight_matmul(x, w, implementation=_i))
                    row(f"{name} {K}x{N} {scheme}", M, K, N, "pallas" if impl == KERNEL else "xla",
                        timeit(fn, x, w, reps=reps), nbytes)


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
            fn = jax.jit(lambda x, q, s, g, _k=wl.k_major: grouped_fp8_matmul(x, q, s, g, _k, **ON))
            row(f"{K}x{N}", M, K, N, impl, timeit(fn, x, wl.values, wl.scales, sizes, reps=reps), nbytes)
        # 1/8 of the buffer routed (an EP8 worst-case receive buffer holding an average load): the skipped
        # tiles should make this about 1/8 of the full buffer's time
        part = jnp.zeros((G,), jnp.int32).at[0].set(M // 8)
        fn = jax.jit(lambda x, q, s, g: grouped_fp8_matmul(x, q, s, g, True, **ON))
        row(f"{K}x{N} (1/8 routed)", M, K, N, "pallas-kmajor", timeit(fn, x, wt.values, wt.scales, part, reps=reps),
            nbytes)


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
        fn = jax.jit(lambda q, *a: paged_attention(q[:, None], *a[:-1], (a[-1] - 1)[:, None], **ON))
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
        fn = jax.jit(lambda *a: paged_attention(*a, **ON))
        t = timeit(fn, q, kv, kv, scale, scale, tables, positions, reps=reps)
        flops = 2 * 2 * N * D * T * T / 2  # causal: half of QK^T and PV
        print(f"| pallas | {T} | {t * 1e6:.1f} | {flops / t / 1e12:.1f} | {100 * flops / t / PEAK_FLOPS:.1f}% |",
              flush=True)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def correctness(big: bool) -> int:
    """Each kernel, un-interpreted on a GPU, against its XLA reference. Returns the number of failures."""
    ex = execution_for(jax.devices()[0])
    print("execution config:", ex.describe(), "\n")
    print("| kernel | shape | max rel. error | |\n|---|---|---|---|")
    failures = 0

    def report(name, shape, err):
        nonlocal failures
        ok = err <= 2e-2
        failures += not ok
        print(f"| {name} | {shape} | {err:.2e} | {'ok' if ok else 'FAIL'} |", flush=True)

    key = jax.random.key(0)
    mm = [(7, 200, 136), (64, 1024, 1024)] + ([(256, 8192, 10240)] if big else [])
    for M, K, N in mm:
        x = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
        w = quantize_block_fp8(jax.random.normal(key, (K, N), jnp.float32) * 0.02)
        for k_major, wl in ((False, w), (True, w.relayout(True))):
            got = block_fp8_matmul(x, wl.values, wl.scales, k_major, **ON)
            report("block_fp8_matmul" + (" k-major" if k_major else ""), (M, K, N),
                   _rel(got, block_fp8_matmul(x, w.values, w.scales, implementation="xla")))
    for M, K, N, G in [(40, 256, 256, 4)] + ([(2048, 8192, 7168, 8)] if big else []):
        x = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
        w = quantize_block_fp8(jax.random.normal(key, (G, K, N), jnp.float32) * 0.02)
        sizes = jnp.asarray(np.random.default_rng(0).multinomial(M - 3, [1 / G] * G), jnp.int32)
        wt = w.relayout(True)
        got = grouped_fp8_matmul(x, wt.values, wt.scales, sizes, True, **ON)
        report("grouped_fp8_matmul k-major", (M, K, N, G),
               _rel(got, grouped_fp8_matmul(x, w.values, w.scales, sizes, implementation="xla")))
    for M, K, N in [(7, 200, 136)] + ([(256, 8192, 10240)] if big else []):
        x = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
        host = np.random.default_rng(M).standard_normal((K, N)).astype(np.float32) * 0.02
        for scheme, fmt in INT_SCHEMES.items():
            w = quantize_int(host, *fmt)
            report(f"int_weight_matmul {scheme}", (M, K, N), _rel(int_weight_matmul(x, w, **ON),
                                                                 int_weight_matmul(x, w, implementation="xla")))
    for M, K, N, G in [(40, 256, 256, 4)] + ([(2048, 8192, 7168, 8)] if big else []):
        x = jax.random.normal(key, (M, K), jnp.float32).astype(jnp.bfloat16)
        host = np.random.default_rng(G).standard_normal((G, K, N)).astype(np.float32) * 0.02
        sizes = jnp.asarray(np.random.default_rng(0).multinomial(M - 3, [1 / G] * G), jnp.int32)
        for scheme in ("wint4 g128", "w4a8"):
            w = quantize_int(host, *INT_SCHEMES[scheme])
            report(f"grouped_int_matmul {scheme}", (M, K, N, G),
                   _rel(grouped_int_matmul(x, w, sizes, **ON),
                        grouped_int_matmul(x, w, sizes, implementation="xla")))
    rng = np.random.default_rng(1)
    for B, T, N, K, D in [(3, 1, 8, 2, 64), (2, 17, 10, 2, 64)] + ([(8, 1, 64, 8, 128), (1, 512, 64, 8, 128)]
                                                                   if big else []):
        page = 16
        n = max(8, -(-T // page) + 1)  # pages per sequence: room for the chunk after a random start
        P = B * n + 1
        q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.bfloat16)
        kv = jnp.asarray(rng.standard_normal((P, page, K, D)) * 20, jnp.float32).astype(jnp.float8_e4m3fn)
        sc = jnp.asarray(rng.uniform(0.01, 0.02, (P, page, K)), jnp.float32)
        tables = jnp.asarray(1 + rng.permutation(B * n).reshape(B, n), jnp.int32)
        start = rng.integers(0, page * n - T, B)
        positions = jnp.asarray(start[:, None] + np.arange(T), jnp.int32)
        args = (q, kv, kv, sc, sc, tables, positions)
        report("paged_attention fp8", (B, T, N, K, D),
               _rel(paged_attention(*args, **ON), paged_attention(*args, implementation="xla")))
        kv16 = jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.bfloat16)  # a bf16 cache: no scales
        args = (q, kv16, kv16, None, None, tables, positions)
        report("paged_attention bf16", (B, T, N, K, D),
               _rel(paged_attention(*args, **ON), paged_attention(*args, implementation="xla")))
    return failures


def end_to_end(preset: str, batches: list[int], new_tokens: int):
    """A random-weight model through LLM(...): greedy decode tok/s per batch size against the HBM roofline,
    then the decode-step profile at each batch size; returns the LLM."""
    from ernie_jax import LLM, ErnieConfig, ErnieForCausalLM, SamplingParams
    from ernie_jax.model.weights import leaf_dtype, param_counts, weight_shapes
    cfg = ErnieConfig.preset(preset)
    t0 = time.perf_counter()
    keys = iter(jax.random.split(jax.random.key(0), 4096))

    def draw(path, shape):  # on the device, in the leaf's dtype: the host would need minutes for 21B draws
        name = str(getattr(path[-1], "key", path[-1]))
        if name.endswith("norm"):
            return jnp.ones(shape, jnp.bfloat16)
        dtype = leaf_dtype(name, jnp.bfloat16)
        return jax.random.normal(next(keys), shape, dtype) * jnp.asarray(0.02, dtype)
    weights = jax.tree_util.tree_map_with_path(draw, weight_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple) and
                                               all(isinstance(d, int) for d in x))
    model = ErnieForCausalLM(cfg, weights, dtype=jnp.bfloat16)
    # the pool sized from device memory, as a user's would be (before the pool left room for the programs'
    # temporaries, the first prefill ran out of memory here: 25.8 GiB short on an H200, 2026-12-04)
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=1024, max_num_batched_tokens=512)
    print(f"KV pool: {llm.engine.instances[0].programs.num_pages} pages "
          f"({llm.engine.instances[0].programs.pool_sizing})", flush=True)
    print(f"\n{preset}: random bf16 weights and engine ready in {time.perf_counter() - t0:.0f} s; ops:",
          model.execution.describe())
    active_bytes = 2 * param_counts(cfg)["active"]
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    print("| batch | new tokens | decode tok/s | roofline tok/s | % of roofline |\n|---|---|---|---|---|")
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for B in batches:
        prompts = [[1] + list(range(100 + b, 164 + b)) for b in range(B)]
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=4))
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        dt = time.perf_counter() - t0
        ctx = 64 + new_tokens / 2
        roof = B * PEAK_BW / (active_bytes + B * ctx * kv_per_token)
        print(f"| {B} | {new_tokens} | {B * new_tokens / dt:.0f} | {roof:.0f} | {100 * B * new_tokens / dt / roof:.1f}% |",
              flush=True)
    # where one decode step goes on this device (the same profile as `python -m ernie_jax.bench step-profile`)
    from ernie_jax.bench.step_profile import profile
    print("\n| batch | step wall ms | plan | inputs | launch | read (incl. wait) | update | decode program alone | tok/s |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for B in batches:
        profile(llm, B, 4, 64)
        r = profile(llm, B, 32, 64, seed=1)
        ms = {k: 1e3 * v for k, v in r.items() if k not in ("streams", "tok_s")}
        print(f"| {B} | {ms['wall']:.2f} | {ms['plan']:.2f} | {ms['inputs']:.2f} | {ms['launch']:.2f} | "
              f"{ms['read']:.2f} | {ms['update']:.2f} | {ms['device']:.2f} | {r['tok_s']:.0f} |", flush=True)
    return llm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and the tiny preset (runs interpreted on a CPU)")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"{datetime.date.today()} | {dev.device_kind} ({dev.platform}) | JAX {jax.__version__}\n")
    failures = correctness(big=not args.smoke)
    if args.smoke:
        matmuls([1, 16], {"small": (256, 256)}, reps=2)
        int_matmuls([1, 16], {"small": (256, 256)}, reps=2)
        grouped([16], reps=2, K=256, N=256, G=2)
        attention([2], 64, reps=2)
        prefill_attention([32], reps=2)
        end_to_end("tiny", [1, 4], 8)
        return int(failures > 0)
    # the end-to-end run and its step profile first: the device time of a lent GPU is short
    sections = [lambda: end_to_end("ernie-4.5-21b-a3b", [1, 32], 64),
                lambda: matmuls([1, 64, 256, 4096], SHAPES, reps=20),
                lambda: int_matmuls([1, 64, 4096], {k: SHAPES[k] for k in ("qkv", "expert_up_gate")}, reps=20),
                lambda: grouped([64, 256, 4096], reps=20), lambda: attention([8, 32], 4096, reps=20),
                lambda: prefill_attention([1024, 4096], reps=10)]
    for section in sections:  # a section that fails on an untried device must not hide the others' figures
        try:
            section()
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"\nFAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
