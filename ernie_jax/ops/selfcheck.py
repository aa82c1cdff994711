"""Start-up self-check of the chosen kernels: each runs once on small shapes against its XLA reference.

A kernel that fails to compile or run, or disagrees with its reference beyond tolerance, is logged and
replaced by the op's next implementation (ExecutionConfig.fall_back), so a first launch on untried
hardware serves instead of crashing; the report says which kernel fell back and why.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from ernie_jax.ops.execution import OPS, ExecutionConfig
from ernie_jax.quant import quantize_block_fp8, quantize_int

log = logging.getLogger("ernie_jax.ops")

TOLERANCE = 2e-2  # max |kernel - reference| / max |reference|: FP8 rounding happens in both


def _matmul_case(rng):
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    w = quantize_block_fp8(rng.standard_normal((256, 384)).astype(np.float32) * 0.05)
    return (x, w.values, w.scales)


def _grouped_case(rng):
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    w = quantize_block_fp8(rng.standard_normal((4, 256, 256)).astype(np.float32) * 0.05)
    return (x, w.values, w.scales, jnp.asarray([7, 0, 20, 10], jnp.int32))


def _int_case(rng):
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    return (x, quantize_int(rng.standard_normal((256, 384)).astype(np.float32) * 0.05, 4, 128))


def _grouped_int_case(rng):
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    w = quantize_int(rng.standard_normal((4, 256, 256)).astype(np.float32) * 0.05, 4, -1, "w4a8")
    return (x, w, jnp.asarray([7, 0, 20, 10], jnp.int32))


def _attention_case(rng):
    # pages of 16 slots, the engine's default block size (smaller pages take the XLA path: paged_attention)
    B, T, N, K, D, P, page = 2, 3, 4, 2, 64, 9, 16
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.bfloat16)
    kv = [jnp.asarray(rng.standard_normal((P, page, K, D)), jnp.bfloat16) for _ in range(2)]
    tables = jnp.asarray([[1, 3, 5, 7], [2, 4, 6, 8]], jnp.int32)
    positions = jnp.asarray([[5, 6, 7], [11, 12, -1]], jnp.int32)
    return (q, kv[0], kv[1], None, None, tables, positions)


CASES = {"block_fp8_matmul": _matmul_case, "grouped_fp8_matmul": _grouped_case, "int_weight_matmul": _int_case,
         "grouped_int_matmul": _grouped_int_case, "paged_attention": _attention_case}


def _run(op: str, implementation: str, ex: ExecutionConfig, args):
    fn = OPS[op].get(implementation).fn
    if op == "paged_attention":
        call = lambda *a: fn(*a, block_slots=ex.attention_block_slots, constrain=lambda x: x,  # noqa: E731
                             platform=ex.platform)
    else:
        call = lambda *a: fn(*a, platform=ex.platform)  # noqa: E731
    return np.asarray(jax.jit(call)(*args), np.float32)


def self_check(ex: ExecutionConfig, device=None) -> ExecutionConfig:
    """ex with every kernel that fails its check replaced by the next implementation of its op."""
    for op, case in CASES.items():
        while ex.uses_kernel(op):
            impl = getattr(ex, op)
            args = case(np.random.default_rng(0))
            if device is not None:
                args = jax.device_put(args, device)
            try:
                got, want = _run(op, impl, ex, args), _run(op, "xla", ex, args)
                err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
                why = None if err <= TOLERANCE else f"self-check mismatch: max relative error {err:.3g}"
            except Exception as e:  # noqa: BLE001 -- any failure to lower, compile or run is a failed check
                why = f"self-check failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if why is None:
                log.info("op %s: kernel %s passed its self-check (max relative error %.2g)", op, impl, err)
                break
            ex = ex.fall_back(op, why)
            log.warning("op %s: %s %s; falling back to %s", op, impl, why, getattr(ex, op))
    return ex


def execution_for(device, kernels: str = "auto", **overrides) -> ExecutionConfig:
    """The execution config for programs on `device`'s platform: each op's preferred supported implementation,
    with the chosen kernels self-checked on that device."""
    from ernie_jax.ops.base import Platform
    ex = ExecutionConfig.select(Platform.of(device), kernels, **overrides)
    return self_check(ex, device) if any(ex.uses_kernel(op) for op in CASES) else ex
