"""Grouped block-FP8 matmul for MoE experts: rows of x [M, K] sorted by group, group g times block-FP8 w[g].

group_sizes [G] say how many rows each group has; rows past their sum produce zeros (lax.ragged_dot's
contract). Implementations, preferred first: the Pallas-Triton kernel (pallas_triton.py; FP8 MMAs), then
the XLA reference (quant.fp8_ragged_dot in w8a8 mode).
"""

from __future__ import annotations

from ernie_jax.ops.base import Implementation, Op, Platform, interpret, kernel_platform, note_fallback
from ernie_jax.ops.block_fp8_matmul.pallas_triton import BK
from ernie_jax.ops.grouped_fp8_matmul.pallas_triton import grouped_block_fp8_matmul_pallas
from ernie_jax.quant import BlockFP8, fp8_ragged_dot


def reference(x, w_q, w_scale, group_sizes, k_major: bool = False, platform: Platform | None = None,
              block: int = BK):
    return fp8_ragged_dot(x, BlockFP8(w_q, w_scale, block=block, k_major=k_major), group_sizes, "w8a8").astype(x.dtype)


def _pallas(x, w_q, w_scale, group_sizes, k_major: bool = False, platform: Platform | None = None):
    return grouped_block_fp8_matmul_pallas(x, w_q, w_scale, group_sizes, k_major,
                                           interpret=interpret(platform))


OP = Op("grouped_fp8_matmul", (
    Implementation("pallas_triton", _pallas, kernel_platform(need_fp8_mma=True), kernel=True),
    Implementation("xla", reference),
))


def grouped_fp8_matmul(x, w_q, w_scale, group_sizes, k_major: bool = False, *, implementation: str = "xla",
                       platform: Platform | None = None, block: int = BK):
    """x [M, K]; w_q [G, K, N] e4m3 ([G, N, K] when k_major); w_scale [G, ceil(K/block), ceil(N/block)] -> [M, N].
    The kernel's tiles are 128 x 128 scale blocks; another block size takes the reference, and says so."""
    if block != BK:
        if OP.get(implementation).kernel:
            note_fallback(OP.name, implementation, f"scale blocks of {block}, the kernel's are {BK}")
        return reference(x, w_q, w_scale, group_sizes, k_major, platform, block)
    return OP.get(implementation).fn(x, w_q, w_scale, group_sizes, k_major, platform)
