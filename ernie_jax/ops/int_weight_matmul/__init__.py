"""Integer-weight matmul: x [M, K] @ IntWeight [K, N] (wint8, wint4 per channel or grouped, W4A8) -> [M, N].

Implementations, preferred first: the Pallas-Triton kernel (pallas_triton.py: integers unpacked and widened
in the kernel; int8 and bf16 MMAs, so any CUDA GPU Triton targets), then the XLA reference
(quant.int_linear), which runs anywhere. Groups the kernel's K steps cannot follow take the reference, and
say so.
"""

from __future__ import annotations

from ernie_jax.ops.base import Implementation, Op, Platform, interpret, kernel_platform, note_fallback
from ernie_jax.ops.int_weight_matmul.pallas_triton import int_weight_matmul_pallas, k_step
from ernie_jax.quant import IntWeight, int_linear


def reference(x, w: IntWeight, platform: Platform | None = None):
    return int_linear(x, w)


def _pallas(x, w: IntWeight, platform: Platform | None = None):
    return int_weight_matmul_pallas(x, w.values, w.scales, bits=w.bits, group=w.group, rows=w.rows,
                                    w4a8=w.compute == "w4a8", interpret=interpret(platform))


OP = Op("int_weight_matmul", (
    Implementation("pallas_triton", _pallas, kernel_platform(need_fp8_mma=False), kernel=True),
    Implementation("xla", reference),
))


def kernel_limit(w: IntWeight) -> str | None:
    """Why the kernels cannot take w's layout, or None."""
    if k_step(-1 if w.per_channel else w.group) is None:
        return f"scale groups of {w.group} rows (the kernel's K steps are 64 or 32 rows)"
    return None


def int_weight_matmul(x, w: IntWeight, *, implementation: str = "xla", platform: Platform | None = None):
    """x [M, K] (bf16/f32); w a 2-d IntWeight [K, N] -> [M, N] in x's dtype."""
    if OP.get(implementation).kernel and (why := kernel_limit(w)):
        note_fallback(OP.name, implementation, why)
        implementation = "xla"
    return OP.get(implementation).fn(x, w, platform)
