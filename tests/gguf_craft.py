"""Crafting damaged GGUF files for the tests: a valid file taken apart and written back with any
count, type, value, dim or offset changed — including lies (an array claiming more items than it
holds), which no GGUF writer can produce.

Taken apart with gguf-py's reader (not ours: the code under test must not parse its own test
inputs); each metadata entry is kept as its raw bytes unless replaced, so an untouched file
writes back byte for byte (tests/test_gguf_bounds.py checks that).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

V = GGUFValueType
CODES = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i", V.FLOAT32: "f",
         V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def string(s: str | bytes, claim: int | None = None) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw) if claim is None else claim) + raw


def value(vtype: int, v) -> bytes:
    """A value's bytes after its type: scalars packed, STRING as u64 length + bytes."""
    if vtype == V.STRING:
        return string(v)
    return struct.pack("<" + CODES[V(vtype)], v)


def entry(vtype: int, v) -> bytes:
    """Type + value of one metadata entry (the key is written by Doc)."""
    return struct.pack("<I", vtype) + value(vtype, v)


def array(itype: int, items: list, claim: int | None = None) -> bytes:
    """An ARRAY entry; `claim` overrides the item count written (a lie when it differs)."""
    body = b"".join(value(itype, v) for v in items)
    return struct.pack("<IIQ", V.ARRAY, itype, len(items) if claim is None else claim) + body


@dataclass
class Tensor:
    name: str
    dims: list[int]  # GGUF order (ne[0] first)
    ggml_type: int
    offset: int

    def info(self) -> bytes:
        dims = b"".join(struct.pack("<Q", d) for d in self.dims)
        tail = struct.pack("<IQ", self.ggml_type, self.offset)
        return string(self.name) + struct.pack("<I", len(self.dims)) + dims + tail


@dataclass
class Doc:
    version: int
    kv: dict[str, bytes]  # key -> type + value bytes
    tensors: list[Tensor]
    data: bytes  # the data section
    alignment: int = 32
    tensor_count: int | None = None  # None: len(tensors)
    kv_count: int | None = None  # None: len(kv)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def to_bytes(self) -> bytes:
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors) if self.tensor_count is None
                                     else self.tensor_count, len(self.kv) if self.kv_count is None else self.kv_count)
        head += b"".join(string(k) + v for k, v in self.kv.items())
        head += b"".join(t.info() for t in self.tensors)
        head += b"\0" * (-len(head) % self.alignment)
        return head + self.data

    def write(self, path: Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)


def take_apart(path: Path) -> Doc:
    r = GGUFReader(path)
    raw = bytes(Path(path).read_bytes())
    kv = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        end = f.offset + sum(int(p.nbytes) for p in f.parts)
        key_len = 8 + len(name.encode())
        kv[name] = raw[f.offset + key_len:end]
    tensors = [Tensor(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - int(r.data_offset))
               for t in r.tensors]
    return Doc(int(r.fields["GGUF.version"].parts[0][0]), kv, tensors, raw[r.data_offset:], int(r.alignment))
