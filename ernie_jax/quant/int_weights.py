"""Integer weights: weight-only INT8 / INT4 linears (FastDeploy's wint8 / wint4) and W4A8 experts.

Format (docs/quantization.md): symmetric integers, no zero point, in the Paddle [in, out] orientation.
- `values` int8. 8 bits: [..., in, out]. 4 bits: two values per byte along `in`, [..., ceil(in/2), out],
  row 2j in the low nibble and row 2j+1 in the high one, so a shard of whole packed rows is a shard of whole
  input rows and the output columns (the axis tensor parallelism splits most) stay one value per byte.
- `scales` f32 [..., ceil(in/group), out], dequant multipliers amax/qmax: W[i, o] ~ q[i, o] * scales[i // group, o].
  group -1 is per output channel (one scale row; Paddle's `weight_quantize` default, what FastDeploy's
  wint8 / wint4 use); 4-bit weights may also take group-wise scales along `in` (64 or 128 usual).
The quantizer rounds to nearest (ties to even) and saturates to +-qmax (127 or 7); an all-zero column or
group gets a tiny positive scale so it stays exactly zero.

Two numerics (`compute`):
- "weight_only" (wint8 / wint4): activations stay in their dtype; a per-channel weight multiplies as its
  integers (exact in bf16: |q| <= 127 < 256) with f32 accumulation and the column scale applied to the sum;
  a grouped weight is dequantized to the activation dtype first (one scale per group and column).
- "w4a8" (the routed experts of `--quantization w4a8`): int4 per-channel weights, activations quantized to
  int8 per token (amax/127), int8 x int8 products accumulated in int32, then times the token's scale and the
  column's. FastDeploy's W4A8 release uses static per-expert activation scales from calibration; with no
  calibration data at load time, this takes each token's own (dynamic) scale.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

INT_COMPUTE = ("weight_only", "w4a8")
QMAX = {8: 127, 4: 7}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IntWeight:
    values: jax.Array  # int8 [..., in, out] (8 bits) or [..., ceil(in/2), out] (4 bits, packed pairs of rows)
    scales: jax.Array  # f32 [..., ceil(in/group), out] (one row when per-channel)
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))
    group: int = dataclasses.field(default=-1, metadata=dict(static=True))  # -1: per output channel
    rows: int = dataclasses.field(default=0, metadata=dict(static=True))  # `in`, which packing may round up
    compute: str = dataclasses.field(default="weight_only", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., in, out] shape."""
        return (*self.values.shape[:-2], self.rows, self.values.shape[-1])

    @property
    def per_channel(self) -> bool:
        return self.group == -1 or self.group >= self.rows

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)

    @property
    def scheme(self) -> str:
        return "w4a8" if self.compute == "w4a8" else f"wint{self.bits}"


def scale_rows(rows: int, group: int) -> int:
    return 1 if group == -1 or group >= rows else -(-rows // group)


def packed_rows(rows: int, bits: int) -> int:
    return -(-rows // 2) if bits == 4 else rows


def check_group(bits: int, group: int, compute: str = "weight_only") -> None:
    """Refuse a scheme this format does not define, naming the parameter."""
    if bits not in QMAX:
        raise ValueError(f"integer weights have 8 or 4 bits, not {bits}")
    if compute not in INT_COMPUTE:
        raise ValueError(f"integer-weight compute mode {compute!r} is not one of {INT_COMPUTE}")
    if group != -1 and (group <= 0 or group % 2):
        raise ValueError(f"quantization group size {group}: expected -1 (per channel) or a positive even number")
    if group != -1 and bits == 8:
        raise ValueError("group-wise scales are for 4-bit weights; wint8 is per channel (group size -1)")
    if compute == "w4a8" and (bits != 4 or group != -1):
        raise ValueError("w4a8 takes 4-bit weights with per-channel scales (FastDeploy's layout); a group size "
                         "applies to wint4")


def check_scheme(scheme: str | None, group: int = -1) -> None:
    """Refuse a `quantization` / `quant_group_size` pair that names no scheme, naming the setting."""
    from ernie_jax.config import QUANTIZATION_SCHEMES
    if scheme is not None and scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization={scheme!r}: expected None or one of {QUANTIZATION_SCHEMES}")
    if group != -1:
        if scheme != "wint4":
            raise ValueError(f"quant_group_size={group}: group-wise scales apply to quantization='wint4' only "
                             f"(quantization is {scheme!r})")
        check_group(4, group)


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7] [..., K, N] -> packed [..., ceil(K/2), N] (row 2j low nibble, 2j+1 high)."""
    if q.shape[-2] % 2:
        q = np.concatenate([q, np.zeros_like(q[..., :1, :])], axis=-2)
    lo, hi = q[..., 0::2, :].astype(np.uint8), q[..., 1::2, :].astype(np.uint8)
    return ((lo & 0x0F) | (hi << 4)).view(np.int8)


def quantize_int(w, bits: int = 8, group: int = -1, compute: str = "weight_only") -> IntWeight:
    """Host (numpy) quantization of w [..., in, out] (any float dtype) to IntWeight; one leading index at a
    time, so a stacked expert weight never has a second full-size f32 copy."""
    check_group(bits, group, compute)
    w = np.asarray(w)
    *lead, K, N = w.shape
    G, qmax = scale_rows(K, group), QMAX[bits]
    gsize = K if G == 1 else group
    values = np.empty((*lead, packed_rows(K, bits), N), np.int8)
    scales = np.empty((*lead, G, N), np.float32)
    for idx in np.ndindex(*lead):
        m = np.asarray(w[idx], np.float32)
        padded = np.zeros((G * gsize, N), np.float32)
        padded[:K] = m
        blocks = padded.reshape(G, gsize, N)
        s = np.maximum(np.max(np.abs(blocks), axis=1), 1e-30) / qmax  # [G, N]
        q = np.clip(np.rint(blocks / s[:, None, :]), -qmax, qmax).astype(np.int8).reshape(G * gsize, N)[:K]
        values[idx] = _pack_int4(q) if bits == 4 else q
        scales[idx] = s
    return IntWeight(values, scales, bits, group, K, compute)


def int_values(w: IntWeight) -> jax.Array:
    """The integers as int8 [..., in, out] (4-bit pairs unpacked with sign extension)."""
    v = jnp.asarray(w.values)
    if w.bits == 8:
        return v
    lo = jnp.right_shift(jnp.left_shift(v, 4), 4)  # arithmetic shifts on int8 sign-extend the nibble
    hi = jnp.right_shift(v, 4)
    both = jnp.stack([lo, hi], axis=-2)  # [..., K/2, 2, N]
    return both.reshape(*v.shape[:-2], 2 * v.shape[-2], v.shape[-1])[..., : w.rows, :]


def _expanded_scales(w: IntWeight) -> jax.Array:
    s = jnp.asarray(w.scales)
    if w.per_channel:
        return s
    return jnp.repeat(s, w.group, axis=-2)[..., : w.rows, :]


def dequantize_int(w: IntWeight, dtype=jnp.float32) -> jax.Array:
    return (int_values(w).astype(jnp.float32) * _expanded_scales(w)).astype(dtype)


def quantize_activations_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token: x [T, K] -> (int8 [T, K], dequant scales [T] f32 = amax/127)."""
    x = x.astype(jnp.float32)
    s = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), 1e-30) / 127.0
    return jnp.clip(jnp.round(x / s[:, None]), -127, 127).astype(jnp.int8), s


def int_linear(x: jax.Array, w: IntWeight) -> jax.Array:
    """y = x @ W for x [..., in] and an IntWeight W [in, out]; output in x's dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    if w.compute == "w4a8":
        xq, xs = quantize_activations_int8(x.reshape(math.prod(lead), K))
        acc = jnp.dot(xq, int_values(w), preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * xs[:, None] * w.scales[0][None, :]
        return y.reshape(*lead, y.shape[-1]).astype(x.dtype)
    if w.per_channel:
        y = jnp.einsum("...i,io->...o", x, int_values(w).astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scales[0]).astype(x.dtype)
    return jnp.einsum("...i,io->...o", x, dequantize_int(w, x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def int_ragged_dot(x: jax.Array, w: IntWeight, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul over rows sorted by group: x [M,K], W [G,K,N] -> [M,N] f32 (the MoE expert matmul)."""
    if not w.per_channel:
        return lax.ragged_dot(x, dequantize_int(w, x.dtype), group_sizes, preferred_element_type=jnp.float32)
    M, G = x.shape[0], w.values.shape[0]
    row_scales = w.scales[jnp.repeat(jnp.arange(G), group_sizes, total_repeat_length=M), 0]  # [M, N]
    if w.compute == "w4a8":
        xq, xs = quantize_activations_int8(x)
        acc = lax.ragged_dot(xq, int_values(w), group_sizes, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * xs[:, None] * row_scales
    y = lax.ragged_dot(x, int_values(w).astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return y * row_scales
