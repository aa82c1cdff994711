"""Independent numpy oracle of FastDeploy's block-FP8 semantics (docs/model.md §4).

Tests use this module as the reference for the FP8 checkpoint format and the FP8 numerics:

* weights: 128x128 blocks over the Paddle [in, out] plane; ``amax = max(|W_block|, 1e-4)``,
  ``q = e4m3fn(W * 448/amax)`` (saturating), stored scale = dequant multiplier ``amax/448`` (fp32,
  shape [ceil(in/128), ceil(out/128)]), so ``W ~= float(q) * scale[i//128, o//128]`` (section 4.4);
* activations: dynamic per-token, per-128-channel-group quantization, ``a = max(|x|, 1e-10)``,
  ``xq = e4m3fn(x * 448/a)``, scale ``a/448`` (section 4.5);
* W8A8 GEMM as DeepGEMM: per K-block exact fp8 dot products, scaled by ``xs[t,kb] * ws[kb,ob]``;
* ``quantize_paddle_checkpoint`` turns a BF16 Paddle checkpoint folder into the FP8-Paddle layout
  (``X.quant_weight`` + ``X.weight_scale``, sections 4.1-4.3).

It deliberately uses only numpy + ml_dtypes (its own safetensors reader/writer, no jax) and must
NOT import ``ernie_jax``: it is the independent check of that package's implementation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
FP8_MAX = 448.0
QUANT_CONFIG = {"dense_quant_type": "block_wise_fp8", "moe_quant_type": "block_wise_fp8",
                "quantization": "mix_quant"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bf16_round(x) -> np.ndarray:
    """Round to bfloat16 (nearest-even) and back to float32."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def _to_fp8(v: np.ndarray) -> np.ndarray:
    """Saturating float32 -> e4m3fn (ml_dtypes alone would give NaN above ~464)."""
    return np.clip(v, -FP8_MAX, FP8_MAX).astype(FP8)


# ----------------------------------------------------------------------------- weights

def per_block_cast_to_fp8(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Paddle [in, out] (or batched [..., in, out]) -> (q e4m3fn [in, out], scale f32 [in/b, out/b])."""
    w = np.asarray(w, np.float32)
    if w.ndim > 2:
        pairs = [per_block_cast_to_fp8(wi, block) for wi in w.reshape(-1, *w.shape[-2:])]
        q = np.stack([p[0] for p in pairs]).reshape(w.shape)
        s = np.stack([p[1] for p in pairs]).reshape(*w.shape[:-2], *pairs[0][1].shape)
        return q, s
    n_in, n_out = w.shape
    bi, bo = _cdiv(n_in, block), _cdiv(n_out, block)
    padded = np.zeros((bi * block, bo * block), np.float32)
    padded[:n_in, :n_out] = w
    view = padded.reshape(bi, block, bo, block)
    amax = np.maximum(np.abs(view).max(axis=(1, 3)), np.float32(1e-4)).astype(np.float32)  # [bi, bo]
    mult = (np.float32(FP8_MAX) / amax).astype(np.float32)
    q = _to_fp8(view * mult[:, None, :, None]).reshape(padded.shape)[:n_in, :n_out]
    scale = (amax / np.float32(FP8_MAX)).astype(np.float32)
    return np.ascontiguousarray(q), scale


def dequantize(q: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """(q [..., in, out], scale [..., in/b, out/b]) -> float32 W[i, o] = q[i, o] * scale[i//b, o//b]."""
    q = np.asarray(q).view(FP8)  # accepts int8/uint8 bit patterns too
    if q.ndim > 2:
        s = np.asarray(scale).reshape(-1, *scale.shape[-2:])
        out = [dequantize(qi, si, block) for qi, si in zip(q.reshape(-1, *q.shape[-2:]), s)]
        return np.stack(out).reshape(q.shape)
    n_in, n_out = q.shape
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), block, 0), block, 1)[:n_in, :n_out]
    return (q.astype(np.float32) * s).astype(np.float32)


# ----------------------------------------------------------------------------- activations / GEMM

def per_token_group_quant(x: np.ndarray, group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] -> (xq e4m3fn [T, K], xs f32 [T, ceil(K/group)]); the last group may be partial."""
    x = np.asarray(x, np.float32)
    (T, K), G = x.shape, _cdiv(x.shape[1], group)
    xq = np.empty((T, K), FP8)
    xs = np.empty((T, G), np.float32)
    for g in range(G):
        sl = slice(g * group, min((g + 1) * group, K))
        a = np.maximum(np.abs(x[:, sl]).max(axis=1), np.float32(1e-10)).astype(np.float32)  # [T]
        xq[:, sl] = _to_fp8(x[:, sl] * (np.float32(FP8_MAX) / a)[:, None])
        xs[:, g] = a / np.float32(FP8_MAX)
    return xq, xs


def w8a8_linear(x: np.ndarray, q: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """FastDeploy/DeepGEMM W8A8: x [..., K] f32, q [K, N] e4m3fn, scale [K/b, N/b] -> f32 [..., N].

    y[t,o] = sum_kb (sum_{i in kb} xq[t,i] * q[i,o]) * xs[t,kb] * scale[kb, o//b]  (f64 oracle).
    """
    x = np.asarray(x, np.float32)
    lead, K, N = x.shape[:-1], x.shape[-1], q.shape[1]
    x2 = x.reshape(-1, K)
    xq, xs = per_token_group_quant(x2, block)
    qf, xqf = np.asarray(q).view(FP8).astype(np.float64), xq.astype(np.float64)
    col_scale = np.repeat(np.asarray(scale, np.float64), block, axis=1)[:, :N]  # [K/b, N]
    y = np.zeros((x2.shape[0], N), np.float64)
    for kb in range(_cdiv(K, block)):
        sl = slice(kb * block, min((kb + 1) * block, K))
        partial = xqf[:, sl] @ qf[sl, :]  # exact: products of fp8 values, few terms
        y += partial * xs[:, kb].astype(np.float64)[:, None] * col_scale[kb][None, :]
    return y.astype(np.float32).reshape(*lead, N)


def weight_only_linear(x: np.ndarray, q: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """x [..., K] @ dequantize(q, scale) -> float32 (f64 matmul)."""
    w = dequantize(q, scale, block).astype(np.float64)
    return (np.asarray(x, np.float64) @ w).astype(np.float32)


# ----------------------------------------------------------------------------- safetensors I/O

_NP = {"BF16": BF16, "U16": BF16, "F32": np.float32, "F16": np.float16, "I8": FP8, "U8": FP8,
       "F8_E4M3": FP8, "I32": np.int32, "I64": np.int64}


def read_safetensors_header(path: str) -> dict:
    """Header dict (includes '__metadata__' if present)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_safetensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (header dtype, array). BF16/U16 -> bfloat16; I8/U8/F8_E4M3 -> float8_e4m3fn bits."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=_NP[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr.copy())
    return out


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> int:
    """Write name -> (header dtype, array) in the given order; returns total tensor bytes."""
    header: dict = {"__metadata__": {"format": "np"}}
    blobs, off = [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in blobs:
            f.write(raw)
    return off


def load_checkpoint(folder: str) -> dict[str, tuple[str, np.ndarray]]:
    """All tensors of a checkpoint folder (every *.safetensors in it and in its mtp/ subfolder)."""
    out = {}
    for sub in ("", "mtp"):
        d = os.path.join(folder, sub)
        if os.path.isdir(d):
            for fn in sorted(os.listdir(d)):
                if fn.endswith(".safetensors"):
                    out.update(read_safetensors(os.path.join(d, fn)))
    return out


# ----------------------------------------------------------------------------- checkpoint conversion

_LIN = r"(self_attn\.(qkv_proj|o_proj)|mlp\.(up_gate_proj|down_proj)" \
       r"|mlp\.(experts\.\d+|shared_experts)\.(up_gate_proj|down_proj))"
_MAIN_RE = re.compile(rf"^ernie\.layers\.\d+\.{_LIN}\.weight$")
_MTP_RE = re.compile(rf"^ernie\.(mtp_block\.\d+\.{_LIN}|mtp_linear_proj\.\d+)\.weight$")
_F32_RE = re.compile(r"(\.mlp\.gate\.weight|\.moe_statics\.e_score_correction_bias)$")


def is_fp8_linear(name: str, mtp_fp8: bool = True) -> bool:
    """True for the `X.weight` keys that the FP8-Paddle checkpoint stores as quant_weight + scale."""
    return bool(_MAIN_RE.match(name) or (mtp_fp8 and _MTP_RE.match(name)))


def _convert_file(src: str, dst: str, quant_dtype: str, mtp_fp8: bool) -> dict[str, int]:
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, (_, arr) in read_safetensors(src).items():
        w = arr.astype(np.float32)
        if is_fp8_linear(name, mtp_fp8):
            q, s = per_block_cast_to_fp8(w)
            base = name[: -len(".weight")]
            out[base + ".quant_weight"] = (quant_dtype, q.view(np.uint8))
            out[base + ".weight_scale"] = ("F32", s)
        elif _F32_RE.search(name):
            out[name] = ("F32", w)
        else:
            out[name] = ("BF16", w.astype(BF16))
    write_safetensors(dst, out)
    return {k: v[1].nbytes for k, v in out.items()}


def quantize_paddle_checkpoint(src_dir: str, dst_dir: str, quant_dtype: str = "I8",
                               mtp_fp8: bool = True) -> None:
    """BF16 Paddle checkpoint folder -> genuine FP8-Paddle layout (same files/shards, mtp/ too).

    Linears become `X.quant_weight` (e4m3fn bits, header dtype `quant_dtype` in I8/U8/F8_E4M3) +
    `X.weight_scale` (F32 [ceil(in/128), ceil(out/128)]); router gate and score bias become F32,
    everything else BF16. config.json gains the FP8 `quantization_config`; other files are copied.
    """
    assert quant_dtype in ("I8", "U8", "F8_E4M3"), quant_dtype
    for sub in ("", "mtp"):
        s_dir, d_dir = os.path.join(src_dir, sub), os.path.join(dst_dir, sub)
        if not os.path.isdir(s_dir):
            continue
        os.makedirs(d_dir, exist_ok=True)
        sizes: dict[str, dict[str, int]] = {}
        for fn in sorted(os.listdir(s_dir)):
            sp, dp = os.path.join(s_dir, fn), os.path.join(d_dir, fn)
            if fn.endswith(".safetensors"):
                sizes[fn] = _convert_file(sp, dp, quant_dtype, mtp_fp8)
            elif fn == "config.json":
                with open(sp) as f:
                    cfg = json.load(f)
                cfg["quantization_config"] = dict(QUANT_CONFIG)
                with open(dp, "w") as f:
                    json.dump(cfg, f, indent=2)
            elif os.path.isfile(sp) and not fn.endswith(".safetensors.index.json"):
                shutil.copyfile(sp, dp)
        for fn in os.listdir(s_dir):
            if fn.endswith(".safetensors.index.json"):
                with open(os.path.join(s_dir, fn)) as f:
                    index = json.load(f)
                index.setdefault("metadata", {})["total_size"] = sum(
                    n for per in sizes.values() for n in per.values())
                index["weight_map"] = dict(sorted((k, shard) for shard, per in sizes.items() for k in per))
                with open(os.path.join(d_dir, fn), "w") as f:
                    json.dump(index, f, indent=2)
