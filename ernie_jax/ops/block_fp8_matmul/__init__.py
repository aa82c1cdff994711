"""Block-FP8 matmul with FastDeploy w8a8 numerics: x [M, K] @ W [K, N] -> [M, N] in x's dtype.

W is block-FP8 (quant.BlockFP8: e4m3 values [K, N], or [N, K] when k_major, and f32 scales per 128 x 128
block). Implementations, preferred first: the Pallas-Triton kernel (pallas_triton.py; FP8 MMAs, so compute
capability 8.9+), the XLA:CPU form (xla_cpu.py: the K blocks as one batched dot), then the XLA reference
(quant.fp8_linear in w8a8 mode), which runs anywhere.
"""

from __future__ import annotations

from ernie_jax.ops.base import Implementation, Op, Platform, interpret, kernel_platform, note_fallback
from ernie_jax.ops.block_fp8_matmul.pallas_triton import BK, block_fp8_matmul_pallas
from ernie_jax.ops.block_fp8_matmul.xla_cpu import block_fp8_matmul_xla_cpu, supports
from ernie_jax.quant import BlockFP8, fp8_linear


def reference(x, w_q, w_scale, k_major: bool = False, platform: Platform | None = None, block: int = BK):
    return fp8_linear(x, BlockFP8(w_q, w_scale, block=block, k_major=k_major), "w8a8")


def _pallas(x, w_q, w_scale, k_major: bool = False, platform: Platform | None = None, block: int = BK):
    return block_fp8_matmul_pallas(x, w_q, w_scale, k_major, interpret=interpret(platform))


def _xla_cpu(x, w_q, w_scale, k_major: bool = False, platform: Platform | None = None, block: int = BK):
    return block_fp8_matmul_xla_cpu(x, w_q, w_scale, k_major, block)


OP = Op("block_fp8_matmul", (
    Implementation("pallas_triton", _pallas, kernel_platform(need_fp8_mma=True), kernel=True),
    Implementation("xla_cpu", _xla_cpu, supports),
    Implementation("xla", reference),
))


def block_fp8_matmul(x, w_q, w_scale, k_major: bool = False, *, implementation: str = "xla",
                     platform: Platform | None = None, block: int = 128):
    """x [M, K] (bf16/f32); w_q [K, N] e4m3 ([N, K] when k_major); w_scale [ceil(K/block), ceil(N/block)] f32.
    The kernel's tiles are 128 x 128 scale blocks; another block size takes the reference, and says so."""
    if block != BK and OP.get(implementation).kernel:
        note_fallback(OP.name, implementation, f"scale blocks of {block}, the kernel's are {BK}")
        return reference(x, w_q, w_scale, k_major, platform, block)
    return OP.get(implementation).fn(x, w_q, w_scale, k_major, platform, block)
