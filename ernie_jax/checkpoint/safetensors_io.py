"""Safetensors files read lazily through numpy memmaps, with every dtype ERNIE checkpoints use.

Owns: header parsing and validation (a truncated or corrupt file is named, never half-read), the
dtype table (`U16` = raw bf16 bits as Paddle writes them; `I8`/`U8`/`F8_E4M3` = float8 e4m3fn bits,
bitcast and never converted by value), sharded checkpoints (`model.safetensors.index.json`) and the
`mtp/` subfolder. The safetensors package's own numpy loader cannot read F8 tensors (docs/xla-notes.md N5); this
reader does not need it. It also writes files (bf16 as `BF16`, fp8 as `F8_E4M3`) for converters and tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: the message names the file and tensor."""


# header dtype -> (numpy storage dtype, logical dtype after bitcast)
DTYPES: dict[str, tuple[np.dtype, np.dtype]] = {
    "F64": (np.dtype(np.float64),) * 2,
    "F32": (np.dtype(np.float32),) * 2,
    "F16": (np.dtype(np.float16),) * 2,
    "BF16": (np.dtype(ml_dtypes.bfloat16),) * 2,
    "U16": (np.dtype(np.uint16), np.dtype(ml_dtypes.bfloat16)),  # Paddle stores bf16 bits as uint16
    "F8_E4M3": (np.dtype(ml_dtypes.float8_e4m3fn),) * 2,
    "I8": (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn)),  # FastDeploy views int8 as e4m3fn
    "U8": (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn)),
    "I32": (np.dtype(np.int32),) * 2,
    "I64": (np.dtype(np.int64),) * 2,
}
_WRITE_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
                np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int32): "I32",
                np.dtype(np.int64): "I64", np.dtype(np.uint16): "U16", np.dtype(np.int8): "I8",
                np.dtype(np.uint8): "U8", np.dtype(np.float64): "F64"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # header dtype string, e.g. "U16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(file: str) -> dict[str, TensorInfo]:
    """Parse and validate one file's header; raise CheckpointError naming the file on any damage."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(f"{file}: corrupt or truncated safetensors header (header length {n}, "
                                      f"file size {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    data_end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype!r}")
        expect = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][0].itemsize
        if e - b != expect or b < 0:
            raise CheckpointError(f"{file}: tensor {name!r} byte range [{b}, {e}) does not match its shape "
                                  f"{list(shape)} and dtype {dtype} ({expect} bytes)")
        data_end = max(data_end, e)
        out[name] = TensorInfo(name, file, dtype, shape, base + b, expect)
    if base + data_end > size:
        raise CheckpointError(f"{file}: truncated: the header describes {base + data_end} bytes but the file has "
                              f"{size}")
    return out


def read_tensor(info: TensorInfo, bitcast: bool = True) -> np.ndarray:
    """The tensor as a read-only memmap view (no copy); bf16/fp8 bit patterns are bitcast, not converted."""
    storage, logical = DTYPES[info.dtype]
    if info.nbytes == 0:
        return np.zeros(info.shape, logical if bitcast else storage)
    arr = np.memmap(info.file, dtype=storage, mode="r", offset=info.offset, shape=info.shape)
    return arr.view(logical) if bitcast else arr


class SafetensorsCheckpoint:
    """All tensors of a checkpoint folder: the index (if any), its shards and an optional `mtp/` subfolder."""

    def __init__(self, path: str, index_only: bool = False):
        """index_only: take the tensor names from model.safetensors.index.json alone (no shard files needed;
        `info()` is then None) — for checking a release's tensor list before downloading it."""
        self.path = os.fspath(path)
        self.tensors: dict[str, TensorInfo | None] = {}
        if index_only:
            for folder in (self.path, os.path.join(self.path, "mtp")):
                index = os.path.join(folder, "model.safetensors.index.json")
                if os.path.isfile(index):
                    self.tensors.update(dict.fromkeys(self._weight_map(index)))
            if not self.tensors:
                raise CheckpointError(f"no model.safetensors.index.json in {self.path!r}")
            return
        if os.path.isfile(self.path):
            files = [self.path]
        else:
            files = self._shard_files(self.path)
            mtp_dir = os.path.join(self.path, "mtp")
            if os.path.isdir(mtp_dir):
                files += self._shard_files(mtp_dir)
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path!r}")
        for file in files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in two files: {self.tensors[name].file} "
                                          f"and {file}")
                self.tensors[name] = info

    @staticmethod
    def _shard_files(folder: str) -> list[str]:
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            files = sorted(set(SafetensorsCheckpoint._weight_map(index).values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
            if missing:
                raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
            return [os.path.join(folder, f) for f in files]
        return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))

    @staticmethod
    def _weight_map(index: str) -> dict[str, str]:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            return weight_map
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo | None:
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        return read_tensor(self.tensors[name])


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor: the header (all names, dtypes and shapes) first, then
    each tensor's bytes as it arrives, so only one tensor is ever held. The file appears under its final
    name only after `close()` checked that every announced tensor was written (`.partial` until then)."""

    def __init__(self, file: str, specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        self.file, self.tmp = file, file + ".partial"
        header: dict = {"__metadata__": metadata or {"format": "np"}}
        offset = 0
        self.order = []
        for name, dname, shape in specs:
            n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dname][0].itemsize
            header[name] = {"dtype": dname, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.order.append((name, dname, tuple(shape)))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.nbytes = offset
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, arr: np.ndarray) -> None:
        want, dname, shape = self.order[self.next]
        arr = np.ascontiguousarray(arr)
        if name != want or arr.shape != shape or DTYPES[dname][0].itemsize != arr.dtype.itemsize:
            raise ValueError(f"{self.file}: expected {want} {list(shape)} ({dname}) next, got {name} "
                             f"{list(arr.shape)} ({arr.dtype})")
        self.f.write(arr.tobytes())
        self.next += 1

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.order):
            raise ValueError(f"{self.file}: {len(self.order) - self.next} announced tensors were never written")
        os.replace(self.tmp, self.file)


def dtype_name(arr: np.ndarray) -> str:
    return _WRITE_NAMES[arr.dtype]


def save_file(tensors: dict[str, np.ndarray], file: str, metadata: dict[str, str] | None = None,
              dtype_names: dict[str, str] | None = None) -> None:
    """Write a safetensors file. `dtype_names` overrides the header dtype per tensor (e.g. "U16" for bf16
    bits, "I8" for fp8 bits) as long as the item size matches."""
    dtype_names = dtype_names or {}
    specs = [(k, dtype_names.get(k) or dtype_name(np.asarray(v)), np.shape(v)) for k, v in tensors.items()]
    w = SafetensorsWriter(file, specs, metadata)
    for k, v in tensors.items():
        w.write(k, np.asarray(v))
    w.close()
