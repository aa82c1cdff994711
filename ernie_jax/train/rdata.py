"""Read character vectors out of an R lazy-load database (`Rdata.rdb` + `Rdata.rdx`) without R.

The `.rdx` index is a gzip-compressed R serialization of a list whose `variables` entry maps each object name
to (offset, length) in the `.rdb`; each blob there is a 4-byte big-endian length followed by a zlib stream
of one serialized object. Objects are serialized in R's XDR format (big-endian, version 2 or 3). This
reader understands the item types that data packages use (vectors, pairlists, symbols, strings,
references) and raises on anything else, naming the type, rather than guessing.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

_NIL, _SYM, _LIST, _CHAR, _LGL, _INT, _REAL, _STR, _VEC, _REF = 254, 1, 2, 9, 10, 13, 14, 16, 19, 255
_SPECIAL_ENVS = {253, 242, 241, 247, 251}  # global/empty/base env, base namespace, missing arg


class RDataError(ValueError):
    """A lazy-load database this reader cannot decode; the message names the file and the problem."""


class _Reader:
    def __init__(self, data: bytes, where: str):
        self.data, self.pos, self.where, self.refs = data, 0, where, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def bytes(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        if len(out) != n:
            raise RDataError(f"{self.where}: truncated object")
        self.pos += n
        return out

    def header(self) -> None:
        if self.bytes(2) != b"X\n":
            raise RDataError(f"{self.where}: not an XDR serialization")
        version = self.int()
        self.int(), self.int()  # writer and minimal reader R versions
        if version == 3:
            self.bytes(self.int())  # native encoding name
        elif version != 2:
            raise RDataError(f"{self.where}: serialization version {version} (2 or 3 expected)")

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == _NIL or kind in _SPECIAL_ENVS:
            return None
        if kind == _REF:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == _SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _CHAR:
            n = self.int()
            latin1 = flags & (1 << 14)  # R's LATIN1_MASK among the levels bits; UTF-8 and ASCII decode as UTF-8
            return None if n == -1 else self.bytes(n).decode("latin-1" if latin1 else "utf-8")
        if kind == _LIST:
            out = {}
            while kind == _LIST:
                attr = self.item() if has_attr else None  # noqa: F841 (a pairlist's attributes are not kept)
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if kind != _NIL:
                raise RDataError(f"{self.where}: pairlist ends in type {kind}")
            return out
        if kind in (_STR, _VEC):
            n = self.length()
            values = [self.item() for _ in range(n)]
        elif kind in (_INT, _LGL):
            n = self.length()
            values = list(struct.unpack_from(f">{n}i", self.bytes(4 * n)))
        elif kind == _REAL:
            n = self.length()
            values = list(struct.unpack_from(f">{n}d", self.bytes(8 * n)))
        else:
            raise RDataError(f"{self.where}: unsupported R item type {kind}")
        if has_attr:
            attrs = self.item()
            names = attrs.get("names") if isinstance(attrs, dict) else None
            if names is not None and kind == _VEC:
                return dict(zip(names, values))
        return values


def unserialize(data: bytes, where: str) -> Any:
    reader = _Reader(data, where)
    reader.header()
    return reader.item()


def _inflate(data: bytes, where: str) -> bytes:
    try:
        return zlib.decompress(data, wbits=47)  # zlib or gzip header, detected
    except zlib.error as e:
        raise RDataError(f"{where}: not a zlib or gzip stream ({e})") from None


def read_lazyload(rdb: str, rdx: str) -> dict[str, Any]:
    """{object name: value} for every object of the database (character vectors as lists of str)."""
    with open(rdx, "rb") as f:
        index = unserialize(_inflate(f.read(), rdx), rdx)
    if not isinstance(index, dict) or "variables" not in index:
        raise RDataError(f"{rdx}: no 'variables' entry; not a lazy-load index")
    with open(rdb, "rb") as f:
        blob = f.read()
    out = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[offset:offset + length]
        if len(chunk) != length or len(chunk) < 4:
            raise RDataError(f"{rdb}: object {name!r} runs past the end of the file")
        (size,) = struct.unpack(">i", chunk[:4])
        data = _inflate(chunk[4:], f"{rdb}: object {name!r}")
        if len(data) != size:
            raise RDataError(f"{rdb}: object {name!r} decompressed to {len(data)} bytes, header says {size}")
        out[name] = unserialize(data, f"{rdb}:{name}")
    return out
