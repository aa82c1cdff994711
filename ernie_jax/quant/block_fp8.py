"""Block-wise FP8 weights (the ERNIE-4.5 FP8 release's format) and their XLA reference matmuls.

Format (docs/model.md §4, FastDeploy semantics): e4m3fn values in the Paddle [in, out]
orientation and f32 scales [ceil(in/128), ceil(out/128)]; the scale is the dequant multiplier amax/448,
so W[i, o] ~ values[i, o] * scales[i // 128, o // 128]. Leading axes (layers, experts) are allowed.
`k_major` values are stored [out, in] instead (K contiguous, the B-operand layout FP8 tensor-core MMAs
take); the model's loader relays them so when it runs the GPU kernels. Scales and `shape` keep the
[in, out] orientation either way, and the XLA paths here read `kn_values`.

Two numerics for a linear (`compute`):
- "w8a8": FastDeploy/DeepGEMM numerics. Activations are quantized per token per 128-channel group
  (scale amax/448), each 128-wide K block is an FP8 x FP8 product accumulated in f32, promoted by the
  activation scale times the weight scale, and summed over K blocks in f32. Default, because it is what
  FastDeploy serves this release with (same outputs as the reference server) and what the FP8 tensor
  cores execute; the Pallas kernels implement the same contract.
- "weight_only": dequantize the weights, then an ordinary matmul in the activation dtype. Closer to the
  BF16 model (no activation rounding); the accuracy report measures both.
Every cast to FP8 saturates (clip to +-448 first): a plain cast overflows to NaN (docs/xla-notes.md N4).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
COMPUTE_MODES = ("w8a8", "weight_only")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockFP8:
    values: jax.Array  # [..., in, out] float8_e4m3fn ([..., out, in] when k_major)
    scales: jax.Array  # [..., ceil(in/block), ceil(out/block)] f32, dequant multipliers
    compute: str = dataclasses.field(default="w8a8", metadata=dict(static=True))
    block: int = dataclasses.field(default=128, metadata=dict(static=True))
    k_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., in, out] shape, whatever the storage layout."""
        shape = tuple(self.values.shape)
        return (*shape[:-2], shape[-1], shape[-2]) if self.k_major else shape

    @property
    def kn_values(self) -> jax.Array:
        """The values as [..., in, out] (a transpose XLA folds into the consuming dot when k_major)."""
        return jnp.swapaxes(self.values, -1, -2) if self.k_major else self.values

    def relayout(self, k_major: bool) -> "BlockFP8":
        """The same weight stored K-major ([..., out, in]) or not. Host (numpy) values become a strided view,
        so placing them copies each device's shard once and the host never holds a second copy."""
        if k_major == self.k_major:
            return self
        v = self.values
        v = (jax.ShapeDtypeStruct((*v.shape[:-2], v.shape[-1], v.shape[-2]), v.dtype)
             if isinstance(v, jax.ShapeDtypeStruct) else v.swapaxes(-1, -2))
        return dataclasses.replace(self, values=v, k_major=k_major)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + self.scales.nbytes)

    def with_compute(self, compute: str) -> "BlockFP8":
        if compute not in COMPUTE_MODES:
            raise ValueError(f"fp8 compute mode {compute!r} is not one of {COMPUTE_MODES}")
        return dataclasses.replace(self, compute=compute)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: int = 128) -> tuple[int, ...]:
    return (*shape[:-2], _ceil(shape[-2], block), _ceil(shape[-1], block))


def _saturating_fp8(x: jax.Array) -> jax.Array:
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


@functools.partial(jax.jit, static_argnames=("block", "compute"))
def quantize_block_fp8(w, block: int = 128, compute: str = "w8a8") -> BlockFP8:
    """FastDeploy's per_block_cast_to_fp8 for any shape (partial edge blocks included): amax per block,
    clamped at 1e-4, values = fp8(w * 448/amax) saturated, scales = amax/448."""
    w = jnp.asarray(w, jnp.float32)
    *lead, I, O = w.shape
    IB, OB = _ceil(I, block), _ceil(O, block)
    pad = [(0, 0)] * len(lead) + [(0, IB * block - I), (0, OB * block - O)]
    blocks = jnp.pad(w, pad).reshape(*lead, IB, block, OB, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-4)  # [..., IB, OB]
    q = _saturating_fp8(blocks * (FP8_MAX / amax)[..., :, None, :, None])
    q = q.reshape(*lead, IB * block, OB * block)[..., :I, :O]
    return BlockFP8(q, amax / FP8_MAX, compute, block)


def _expand_scales(scales: jax.Array, shape: tuple[int, ...], block: int) -> jax.Array:
    s = jnp.repeat(jnp.repeat(scales, block, axis=-2), block, axis=-1)
    return s[..., : shape[-2], : shape[-1]]


def dequantize(w: BlockFP8, dtype=jnp.float32) -> jax.Array:
    return (w.kn_values.astype(jnp.float32) * _expand_scales(w.scales, w.shape, w.block)).astype(dtype)


def quantize_activations(x: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """Per token, per `block` channels: x [T,K] -> (fp8 [T, KB*block] zero-padded, scales [T, KB] f32)."""
    T, K = x.shape
    KB = _ceil(K, block)
    g = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, KB * block - K))).reshape(T, KB, block)
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), 1e-10)
    q = _saturating_fp8(g * (FP8_MAX / amax)[..., None])
    return q.reshape(T, KB * block), amax / FP8_MAX


def _padded_k(values: jax.Array, block: int) -> jax.Array:
    K = values.shape[-2]
    pad = [(0, 0)] * (values.ndim - 2) + [(0, _ceil(K, block) * block - K), (0, 0)]
    return jnp.pad(values, pad)


def fp8_linear(x: jax.Array, w: BlockFP8, compute: str | None = None) -> jax.Array:
    """y = x @ W for x [..., in] and a BlockFP8 W [in, out]; output in x's dtype."""
    compute = compute or w.compute
    if compute == "weight_only":
        return jnp.einsum("...i,io->...o", x, dequantize(w, x.dtype),
                          preferred_element_type=jnp.float32).astype(x.dtype)
    lead, (K, N), B = x.shape[:-1], w.shape, w.block
    xq, xs = quantize_activations(x.reshape(-1, K), B)
    KB = xs.shape[1]
    wv = _padded_k(w.kn_values, B).reshape(KB, B, N)
    ws = jnp.repeat(w.scales, B, axis=-1)[:, :N]  # [KB, N]

    def step(acc, kb):
        part = jnp.dot(lax.dynamic_slice_in_dim(xq, kb * B, B, axis=1), wv[kb], preferred_element_type=jnp.float32)
        return acc + part * xs[:, kb, None] * ws[kb][None, :], None

    acc, _ = lax.scan(step, jnp.zeros((xq.shape[0], N), jnp.float32), jnp.arange(KB))
    return acc.reshape(*lead, N).astype(x.dtype)


def fp8_ragged_dot(x: jax.Array, w: BlockFP8, group_sizes: jax.Array, compute: str | None = None) -> jax.Array:
    """Grouped matmul over rows sorted by group: x [M,K], W [G,K,N] -> [M,N] f32 (the MoE expert matmul)."""
    compute = compute or w.compute
    if compute == "weight_only":
        return lax.ragged_dot(x, dequantize(w, x.dtype), group_sizes, preferred_element_type=jnp.float32)
    M, (G, _K, N), B = x.shape[0], w.shape, w.block
    xq, xs = quantize_activations(x, B)
    KB = xs.shape[1]
    wv = _padded_k(w.kn_values, B).reshape(G, KB, B, N)
    row_group = jnp.repeat(jnp.arange(G), group_sizes, total_repeat_length=M)
    ws_rows = w.scales[row_group]  # [M, KB, NB]

    def step(acc, kb):
        part = lax.ragged_dot(lax.dynamic_slice_in_dim(xq, kb * B, B, axis=1), wv[:, kb], group_sizes,
                              preferred_element_type=jnp.float32)
        wsc = jnp.repeat(ws_rows[:, kb, :], B, axis=-1)[:, :N]
        return acc + part * xs[:, kb, None] * wsc, None

    acc, _ = lax.scan(step, jnp.zeros((M, N), jnp.float32), jnp.arange(KB))
    return acc
