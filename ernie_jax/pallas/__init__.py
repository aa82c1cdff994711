"""Pallas GPU kernels, each with an XLA reference of the same contract, behind one dispatch entry point.

`implementation`: "pallas" (the kernel; on a CPU it runs in the Pallas interpreter), "xla" (the reference),
or None = pallas on GPU, xla elsewhere. The model calls these entry points, so a GPU run picks the
kernels. A pallas_call is not partitioned by GSPMD, so sharded programs call them inside shard_map, per
device on its shards (sharding/linear.py, sharding/attention.py, the expert-parallel block); layouts that
cannot run per device keep the XLA paths.
"""

from __future__ import annotations

import jax

from ernie_jax.pallas.block_fp8_matmul import block_fp8_matmul_pallas, block_fp8_matmul_reference
from ernie_jax.pallas.grouped_fp8_matmul import grouped_block_fp8_matmul_pallas, grouped_block_fp8_matmul_reference
from ernie_jax.pallas.paged_attention import paged_attention_pallas, paged_attention_reference
from ernie_jax.quant import BlockFP8

IMPLEMENTATIONS = ("pallas", "xla")


def resolve(implementation: str | None) -> str:
    if implementation is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS} or None")
    return implementation


def use_kernels() -> bool:
    """Whether the model routes through the kernels (on a GPU); sharded code asks inside its shard_map
    wrappers."""
    return resolve(None) == "pallas"


def block_fp8_matmul(x, w_q, w_scale, implementation: str | None = None, k_major: bool = False):
    """x [M, K] @ block-FP8 W [K, N] (stored [N, K] when k_major) with FastDeploy w8a8 numerics -> [M, N] in
    x's dtype."""
    if resolve(implementation) == "xla":
        return block_fp8_matmul_reference(x, w_q, w_scale, k_major)
    return block_fp8_matmul_pallas(x, w_q, w_scale, k_major, interpret=jax.default_backend() != "gpu")


def grouped_block_fp8_matmul(x, w_q, w_scale, group_sizes, implementation: str | None = None,
                             k_major: bool = False):
    """Rows of x sorted by group; group g multiplies block-FP8 w_q[g] ([K, N], or [N, K] when k_major)
    -> [M, N] in x's dtype."""
    if resolve(implementation) == "xla":
        return grouped_block_fp8_matmul_reference(x, w_q, w_scale, group_sizes, k_major)
    return grouped_block_fp8_matmul_pallas(x, w_q, w_scale, group_sizes, k_major,
                                           interpret=jax.default_backend() != "gpu")


def kernel_layout(weights):
    """The weights pytree with its w8a8 block-FP8 matrices stored K-major, the layout the kernels' FP8 MMAs
    read without a transpose (block_fp8_matmul.py); the loader applies it when the kernels are in use."""
    def relay(w):
        return w.relayout(True) if isinstance(w, BlockFP8) and w.compute == "w8a8" else w
    return jax.tree.map(relay, weights, is_leaf=lambda x: isinstance(x, BlockFP8))


def paged_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions,
                    implementation: str | None = None):
    """Causal attention of q [B, T, N, D] at positions [B, T] over each sequence's paged KV cache (bf16, or
    fp8 with scales) -> [B, T, N, D]: chunked prefill, and decode with T = 1."""
    if resolve(implementation) == "xla":
        return paged_attention_reference(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions)
    return paged_attention_pallas(q, k_pages, v_pages, k_scale, v_scale, block_tables, positions,
                                  interpret=jax.default_backend() != "gpu")


def paged_decode_attention(q, k_pages, v_pages, k_scale, v_scale, block_tables, lengths,
                           implementation: str | None = None):
    """Decode: one query token per sequence (q [B, N, D]) whose cache holds `lengths` [B] tokens -> [B, N, D]."""
    out = paged_attention(q[:, None], k_pages, v_pages, k_scale, v_scale, block_tables, (lengths - 1)[:, None],
                          implementation)
    return out[:, 0]


__all__ = ["IMPLEMENTATIONS", "block_fp8_matmul", "grouped_block_fp8_matmul", "kernel_layout", "paged_attention",
           "paged_decode_attention", "resolve", "use_kernels"]
