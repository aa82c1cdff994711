"""Block-FP8 w8a8 matmul as XLA:CPU runs it well: the reference's numbers without its loop over K blocks.

The reference (quant.fp8_linear) is a lax.scan over the 128-wide K blocks, and XLA:CPU copies each block's
slice of the weight out of it on every step of that loop (a weight-sized copy per matmul per decode step).
Here every K block's partial product comes from one batched dot over a [KB, block, N] view of the weight
(no copy), and the partial products are promoted by their activation and weight scales and summed in the
reference's order (block 0 first, then 1, ...), so the result differs from the reference's only in the
order of additions inside a block's dot, as any two dot kernels do.

The values are multiplied in the dtype the CPU layout holds them in (model/weights.cpu_layout): every
e4m3 value, weight or quantized activation, is exact in bf16 and in f32, and each product of two is exact
in the f32 accumulator, so both give the same numbers. The form is chosen on CPUs with native bf16 dot
products, with the values held as bf16 (half the bytes, and the bf16 units); with f32 values it measured
no faster than the reference's loop, so CPUs without those units keep the reference and f32 values
(benchmarks/RESULTS.md, "A block-FP8 matmul for XLA:CPU").
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ernie_jax.ops.base import Platform
from ernie_jax.quant.block_fp8 import _padded_k, quantize_activations

# CPU flags (Linux /proc/cpuinfo) of native bf16 dot products: AVX512-BF16 (Zen 4+, Cooper Lake+) and AMX.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")
VECTOR_FLAGS = ("avx2", "avx512f", *BF16_DOT_FLAGS)  # what benchmarks name a CPU by


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where that file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def vector_extensions() -> str:
    """The vector extensions of VECTOR_FLAGS this CPU has, space-separated."""
    return " ".join(flag for flag in VECTOR_FLAGS if flag in cpu_flags())


def values_dtype() -> str:
    """The dtype XLA:CPU multiplies block-FP8 values in on this machine: "bfloat16" on a CPU with native bf16
    dot products, else "float32" (without them a bf16 matmul converts to f32 first and is no faster)."""
    return "bfloat16" if cpu_flags() & set(BF16_DOT_FLAGS) else "float32"


def supports(platform: Platform) -> str | None:
    if platform.backend != "cpu":
        return "the K blocks as one batched dot is a form for XLA:CPU"
    if values_dtype() != "bfloat16":
        return f"this CPU has no native bf16 dot products ({' or '.join(BF16_DOT_FLAGS)})"
    return None


def block_fp8_matmul_xla_cpu(x, w_q, w_scale, k_major: bool = False, block: int = 128):
    """x [M, K] @ block-FP8 W -> [M, N] in x's dtype; w_q [K, N] ([N, K] when k_major) holds e4m3 values
    as float8_e4m3fn, bf16 or f32; w_scale [ceil(K/block), ceil(N/block)]."""
    M, K = x.shape
    values = jnp.swapaxes(w_q, -1, -2) if k_major else w_q
    N = values.shape[-1]
    xq, xs = quantize_activations(x, block)  # [M, KB*block] e4m3, [M, KB] f32
    KB = xs.shape[1]
    dtype = values.dtype if values.dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
    wv = _padded_k(values, block).reshape(KB, block, N)
    parts = jnp.einsum("mkb,kbn->kmn", xq.astype(dtype).reshape(M, KB, block), wv.astype(dtype),
                       preferred_element_type=jnp.float32)  # [KB, M, N]
    ws = jnp.repeat(w_scale, block, axis=-1)[:, :N]  # [KB, N]
    acc = jnp.zeros((M, N), jnp.float32)
    for kb in range(KB):  # unrolled: one elementwise fusion, in the reference's order of additions
        acc = acc + parts[kb] * xs[:, kb, None] * ws[kb][None, :]
    return acc.astype(x.dtype)
