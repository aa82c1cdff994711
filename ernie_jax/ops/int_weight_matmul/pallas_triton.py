"""Integer-weight matmul (wint8, wint4, W4A8; quant/int_weights.py) as a Pallas-Triton GPU kernel.

y[t, o] = sum over K steps of (x[t, step] . q[step, o]) * scale[group of the step, o], with the integers
unpacked and widened inside the kernel (the weights cross HBM at 1 or 1/2 byte a value, which is what
weight-only quantization buys a memory-bound decode step):
- 8-bit: each [S, 128] int8 tile is widened to the activation dtype (exact: |q| <= 127) for the MMA.
- 4-bit: each packed [S/2, 128] tile holds rows 2j (low nibble) and 2j+1 (high nibble); two arithmetic
  shifts sign-extend the nibbles, and the wrapper hands the kernel x's even and odd columns as two operands,
  so the step is x_even . low + x_odd . high with no interleave inside the kernel.
- W4A8: x arrives quantized per token (int8 and a scale per row, quant_int's numerics); the nibbles stay
  int8 and the MMA accumulates in int32; the row and column scales multiply the sum once at the end.
Per-channel scales multiply the f32 sum once at the end; group-wise scales (group a multiple of the step S)
multiply each step's partial sum. Steps are 64 K rows (32 when the group is 32 or 96: a step never spans
two groups); Triton's MMA needs 16 or more along each dimension, so 4-bit steps are at least 32 rows.
The grouped MoE variant (grouped_int_matmul/) runs the same tile product with the tile's expert picked from
a table. Backend: Pallas-Triton, as the FP8 kernels (block_fp8_matmul/pallas_triton.py say why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ernie_jax.ops.block_fp8_matmul.pallas_triton import _block_m, _round_up
from ernie_jax.quant.int_weights import quantize_activations_int8

BN = 128


def k_step(group: int) -> int | None:
    """K rows per kernel step for scales in groups of `group` (-1: per channel), or None if none fits."""
    for s in (64, 32):
        if group == -1 or group % s == 0:
            return s
    return None


def tile_product(x_refs, w_ref, lead: tuple, i, j, k, *, bm: int, S: int, bits: int, w4a8: bool):
    """Step k's partial product of row tile i and column tile j: [bm, BN] f32 (int32 under W4A8)."""
    acc_type = jnp.int32 if w4a8 else jnp.float32
    if bits == 8:
        xt = x_refs[0][pl.ds(i * bm, bm), pl.ds(k * S, S)]
        w = w_ref[(*lead, pl.ds(k * S, S), pl.ds(j * BN, BN))]
        return jnp.dot(xt, w.astype(xt.dtype), preferred_element_type=acc_type)
    h = S // 2
    w = w_ref[(*lead, pl.ds(k * h, h), pl.ds(j * BN, BN))]
    low = lax.shift_right_arithmetic(lax.shift_left(w, jnp.int8(4)), jnp.int8(4))
    high = lax.shift_right_arithmetic(w, jnp.int8(4))
    xe = x_refs[0][pl.ds(i * bm, bm), pl.ds(k * h, h)]
    xo = x_refs[1][pl.ds(i * bm, bm), pl.ds(k * h, h)]
    return (jnp.dot(xe, low.astype(xe.dtype), preferred_element_type=acc_type)
            + jnp.dot(xo, high.astype(xo.dtype), preferred_element_type=acc_type))


def accumulate(x_refs, w_ref, s_ref, xs_ref, lead: tuple, i, j, *, steps: int, bm: int, S: int, bits: int,
               group: int, w4a8: bool):
    """Tile (i, j) over all K steps, scaled: [bm, BN] f32."""
    scale = s_ref[(*lead, 0, pl.ds(j * BN, BN))][None, :]
    if group == -1:
        def body(k, acc):
            return acc + tile_product(x_refs, w_ref, lead, i, j, k, bm=bm, S=S, bits=bits, w4a8=w4a8)
        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, BN), jnp.int32 if w4a8 else jnp.float32))
        acc = acc.astype(jnp.float32) * scale
        return acc * xs_ref[pl.ds(i * bm, bm), :] if w4a8 else acc

    def grouped(k, acc):
        s = s_ref[(*lead, (k * S) // group, pl.ds(j * BN, BN))][None, :]
        return acc + tile_product(x_refs, w_ref, lead, i, j, k, bm=bm, S=S, bits=bits, w4a8=False) * s
    return lax.fori_loop(0, steps, grouped, jnp.zeros((bm, BN), jnp.float32))


def prepare(x, values, scales, *, bits: int, rows: int, S: int, bm: int, w4a8: bool):
    """Zero-padded operands: x's rows to the row tile, K to whole steps (4-bit: split into even and odd
    columns), N to whole column tiles. W4A8 quantizes x per token first. -> (x operands, values, scales,
    row scales [Mp, 1] f32 or None)."""
    M, N = x.shape[0], values.shape[-1]
    Mp, Kp, Np = _round_up(M, bm), _round_up(rows, S), _round_up(N, BN)
    xs = None
    if w4a8:
        x, xs = quantize_activations_int8(x)
        xs = jnp.pad(xs, (0, Mp - M))[:, None]
    x = jnp.pad(x, ((0, Mp - M), (0, Kp - rows)))
    xops = (x,) if bits == 8 else (x[:, 0::2], x[:, 1::2])
    kv = Kp if bits == 8 else Kp // 2
    lead = [(0, 0)] * (values.ndim - 2)
    values = jnp.pad(values, lead + [(0, kv - values.shape[-2]), (0, Np - N)])
    scales = jnp.pad(scales.astype(jnp.float32), lead + [(0, 0), (0, Np - N)])
    return xops, values, scales, xs


def launch(kernel, args: tuple, rows: int, cols: int, bm: int, dtype, interpret: bool):
    """The pallas_call over a (rows / bm, cols / BN) grid of output tiles, every operand in HBM."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
        grid=(rows // bm, cols // BN),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(args),
        out_specs=pl.BlockSpec((bm, BN), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(*args)


def _kernel(*refs, bits: int, **kw):
    n_x = 1 if bits == 8 else 2
    x_refs, (w_ref, s_ref), rest = refs[:n_x], refs[n_x:n_x + 2], refs[n_x + 2:]
    xs_ref, o_ref = (rest[0], rest[1]) if kw["w4a8"] else (None, rest[0])
    i, j = pl.program_id(0), pl.program_id(1)
    o_ref[...] = accumulate(x_refs, w_ref, s_ref, xs_ref, (), i, j, bits=bits, **kw).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group", "rows", "w4a8", "interpret"))
def int_weight_matmul_pallas(x, values, scales, *, bits: int, group: int, rows: int, w4a8: bool = False,
                             interpret: bool = False):
    """x [M, K] (bf16/f32); values int8 [K, N] (8 bits) or [ceil(K/2), N] (4 bits, packed); scales f32
    [ceil(K/group), N] (one row when per channel) -> [M, N] in x's dtype."""
    M, N = x.shape[0], values.shape[-1]
    S, bm = k_step(group), _block_m(M)
    group = -1 if group == -1 or group >= rows else group
    xops, wp, sp, xs = prepare(x, values, scales, bits=bits, rows=rows, S=S, bm=bm, w4a8=w4a8)
    Mp, Np = xops[0].shape[0], wp.shape[-1]
    steps = (xops[0].shape[1] * (1 if bits == 8 else 2)) // S
    args = (*xops, wp, sp) + ((xs,) if w4a8 else ())
    kernel = functools.partial(_kernel, bits=bits, steps=steps, bm=bm, S=S, group=group, w4a8=w4a8)
    return launch(kernel, args, Mp, Np, bm, x.dtype, interpret)[:M, :N]
