"""Causal GQA attention over a paged KV cache: chunked prefill (T query tokens) and decode (T = 1).

q [B,T,N,D] at positions [B,T] (-1: padding); k_pool, v_pool [P,page,K,D] (bf16, its uint16 bits
(storage.py), or fp8 with scales [P,page,K]); tables [B,n] -> [B,T,N*D] in q's dtype. Implementations,
preferred first: the Pallas-Triton kernel (GPU), a compiled CPU kernel for decode over bf16 pools
(ops/cpu_kernels/paged_attention.cc; other shapes and pools as xla_cpu), the XLA:CPU block-diagonal decode
form (xla_cpu.py), the XLA reference (reference.py: blocked online softmax, slots grouped by KV head). A
padding position's output is 0 in every implementation (it sees no key; left alone, each form would average
whatever its masked blocks held, and the kernel's self-check would compare two arbitrary rows: it failed on
the H200).
`block_slots`: key slots per step of the XLA forms' loop (None: the whole table in one block, what a mesh
needs; `constrain` then pins each gathered block's sharding).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ernie_jax.ops import cpu_kernels
from ernie_jax.ops.base import Implementation, Op, Platform, interpret, kernel_platform, note_fallback, only_on
from ernie_jax.ops.paged_attention.pallas_triton import paged_attention_pallas
from ernie_jax.ops.paged_attention.reference import blocked_attention
from ernie_jax.ops.paged_attention.storage import BF16_BITS
from ernie_jax.ops.paged_attention.xla_cpu import paged_attention_xla_cpu


def _zero_padding(out, positions):  # out [B,T,N*D]
    return jnp.where(positions[..., None] >= 0, out, jnp.zeros((), out.dtype))


def _pallas(q, k_pool, v_pool, k_scale, v_scale, tables, positions, *, block_slots, constrain, platform):
    if k_pool.dtype == jnp.dtype(BF16_BITS):
        raise ValueError("the paged attention kernel reads bf16 or fp8 pools, not uint16 bits (storage.py)")
    B, T, N, D = q.shape
    out = paged_attention_pallas(q, k_pool, v_pool, k_scale, v_scale, tables, positions,
                                 interpret=interpret(platform)).reshape(B, T, N * D)
    return _zero_padding(out, positions)


def _xla_cpu(*args, block_slots, constrain, platform):
    return _zero_padding(paged_attention_xla_cpu(*args, block_slots=block_slots, constrain=constrain), args[-1])


def _cpu_decode(q, k_pool, v_pool, k_scale, v_scale, tables, positions, *, block_slots, constrain, platform):
    from ernie_jax.ops.cpu_kernels.attention import paged_decode_attention, takes
    if takes(q, k_pool, v_pool, k_scale) and block_slots is not None:
        out = paged_decode_attention(q, k_pool, v_pool, tables, positions, block_slots).astype(q.dtype)
        return _zero_padding(out, positions)
    return _xla_cpu(q, k_pool, v_pool, k_scale, v_scale, tables, positions, block_slots=block_slots,
                    constrain=constrain, platform=platform)


def _reference(*args, block_slots, constrain, platform):
    return _zero_padding(blocked_attention(*args, block_slots=block_slots, constrain=constrain), args[-1])


OP = Op("paged_attention", (
    Implementation("pallas_triton", _pallas, kernel_platform(need_fp8_mma=False), kernel=True),
    Implementation("cpu_decode", _cpu_decode, cpu_kernels.supports("paged_attention"), library="paged_attention"),
    Implementation("xla_cpu", _xla_cpu, only_on("cpu", "the block-diagonal decode form is tuned for XLA:CPU")),
    Implementation("xla", _reference),
))


def paged_attention(q, k_pool, v_pool, k_scale, v_scale, tables, positions, *, implementation: str = "xla",
                    block_slots: int | None = 64, constrain: Callable = lambda x: x,
                    platform: Platform | None = None):
    D, page = q.shape[-1], k_pool.shape[1]
    why = f"head dim {D} is not a power of two" if D & (D - 1) else \
        f"pages of {page} key slots (the kernel's score and value products need 16 or more)" if page < 16 else None
    if OP.get(implementation).kernel and why:  # Triton tiles are powers of two, MMA operands 16 wide or more
        note_fallback(OP.name, implementation, why)
        implementation = OP.choose(platform, after=implementation)[0] if platform is not None else "xla"
    return OP.get(implementation).fn(q, k_pool, v_pool, k_scale, v_scale, tables, positions,
                                     block_slots=block_slots, constrain=constrain, platform=platform)
