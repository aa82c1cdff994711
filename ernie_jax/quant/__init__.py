"""Quantized weight formats and their XLA reference matmuls.

- block_fp8.py: `BlockFP8`, the ERNIE-4.5 FP8 release's block-wise e4m3 weights (w8a8 or weight-only).
- int_weights.py: `IntWeight`, weight-only INT8 / INT4 (FastDeploy's wint8 / wint4) and W4A8 experts.
`SCHEMES` names what `--quantization` takes; model/weights.py says which leaves each scheme quantizes.
"""

from ernie_jax.config import QUANTIZATION_SCHEMES as SCHEMES
from ernie_jax.quant.block_fp8 import (COMPUTE_MODES, FP8, FP8_MAX, BlockFP8, dequantize, fp8_linear, fp8_ragged_dot,
                                       quantize_activations, quantize_block_fp8, scale_shape)
from ernie_jax.quant.int_weights import (INT_COMPUTE, IntWeight, check_group, check_scheme, dequantize_int, int_linear,
                                         int_ragged_dot, int_values, packed_rows, quantize_int, scale_rows)

QUANTIZED = (BlockFP8, IntWeight)


def is_quantized(x) -> bool:
    return isinstance(x, QUANTIZED)


__all__ = ["COMPUTE_MODES", "FP8", "FP8_MAX", "INT_COMPUTE", "QUANTIZED", "SCHEMES", "BlockFP8", "IntWeight",
           "check_group", "check_scheme", "dequantize", "dequantize_int", "fp8_linear", "fp8_ragged_dot", "int_linear",
           "int_ragged_dot", "int_values", "is_quantized", "packed_rows", "quantize_activations",
           "quantize_block_fp8", "quantize_int", "scale_rows", "scale_shape"]
