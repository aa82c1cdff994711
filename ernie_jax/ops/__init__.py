"""The op layer: each op the model calls per backend, with its XLA reference and its other implementations.

One folder per op (tokamax's layout): block_fp8_matmul/, grouped_fp8_matmul/, int_weight_matmul/,
grouped_int_matmul/, paged_attention/, routed_experts/; dense.py holds the plain linear and SwiGLU that route
quantized weights to their op.
Each op's __init__ lists its implementations in order of preference, each saying what it supports
(base.py); the execution config (execution.py) records the choice per op, once, and selfcheck.py checks
chosen kernels against their references on the device at start-up. Ops import nothing from the model.
"""

import jax

from ernie_jax.ops.base import Platform
from ernie_jax.ops.execution import REFERENCE, ExecutionConfig
from ernie_jax.quant import BlockFP8

__all__ = ["REFERENCE", "ExecutionConfig", "Platform", "kernel_layout"]


def kernel_layout(weights):
    """The weights pytree with its w8a8 block-FP8 matrices stored K-major, the layout the FP8 kernels' MMAs
    read without a transpose (block_fp8_matmul/pallas_triton.py)."""
    def relay(w):
        return w.relayout(True) if isinstance(w, BlockFP8) and w.compute == "w8a8" else w
    return jax.tree.map(relay, weights, is_leaf=lambda x: isinstance(x, BlockFP8))
