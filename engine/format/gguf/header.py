"""The GGUF header parser: metadata values and the tensor table, every count bounded first.

Why not gguf-py's GGUFReader: it trusts the counts it reads and builds one numpy view per
metadata array item as it goes (about 760 bytes and 70 us each), so a file whose array claims
2^31 items (64 present) grew to 5.4 GB before failing, and a 4 MB file of 4M real items took
3.2 GB; it also computes a tensor's byte count in uint64 numpy arithmetic, so dims whose product
wraps past 2^64 (or a dim of 0) give a zero-byte tensor that passes a bounds check, and its
offset sum wraps the same way. This parser walks the layout with struct over a read-only memory
map and Python integers, reads numeric arrays with one np.frombuffer each, allocates nothing
per claimed item before the bytes for it are known to exist, and refuses with one
ModelFormatError line:
- counts (tensors, metadata entries, array items, string lengths) that the bytes left in the
  file cannot hold, or that exceed a cap far above any real model (MAX_*);
- an unknown value type, arrays nested deeper than MAX_DEPTH, a key or tensor name that is
  not UTF-8 or appears twice, a bad general.alignment (type UINT32, a power of two);
- tensor dims: 1 to MAX_DIMS of them (ggml's GGML_MAX_DIMS), each in [1, 2^63) as ggml's
  int64_t ne[] holds, the first a whole number of the type's blocks; an unknown ggml type;
- tensor offsets (relative to the aligned data section) that are not a multiple of the
  alignment, run past the end of the file, or overlap another tensor's bytes.
- a big-endian file (written for s390x): the dequantization assumes little-endian blocks.
The header format is llama.cpp's GGUF spec (ggml's docs: gguf.md; versions 2 and 3; u64 counts). Metadata values
come out as Python values: str (strict UTF-8; in arrays, invalid bytes replaced, as token lists
may hold partial UTF-8), int, bool, float (a FLOAT32 scalar as the shortest decimal that is
that float32: 1e-06, not 9.999999974752427e-07) or lists of them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.base.errors import ModelFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM = (1 << 63) - 1  # ne[] is int64_t
MAX_TENSORS = 1 << 20  # DeepSeek-V3 with stacked experts has ~1,100
MAX_KV = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # all metadata arrays together; a 262k vocab's tokens, types, scores, merges are ~1M
MAX_KEY = 1 << 16  # the GGUF spec: keys are at most 65535 bytes
MAX_TENSOR_NAME = 1 << 10  # ggml's own limit is 64 (GGML_MAX_NAME); this is only a sanity cap
MAX_DEPTH = 2  # an array of arrays at most (gguf-py flattens deeper ones anyway)
STRING, ARRAY = 8, 9
# GGUFValueType -> (struct code, size); STRING and ARRAY are variable.
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
           7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
MIN_ITEM = {**{t: s for t, (_, s) in SCALARS.items()}, STRING: 8, ARRAY: 12}  # bytes an item needs at least
NP_TYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1", 10: "<u8", 11: "<i8",
            12: "<f8"}
UINT32, FLOAT32, BOOL = 4, 6, 7


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # GGUF order (ne[0] first: the contiguous one)
    ggml_type: int
    offset: int  # relative to the data section
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    alignment: int
    data_offset: int  # where the data section starts (the header's length, padded)
    tensors: tuple[TensorEntry, ...]
    metadata: dict  # key -> Python value, in file order


class _Cursor:
    """Reads little- or big-endian fields from a buffer; every read is bounds-checked first."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: not a readable GGUF file ({what})")

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has {self.left()} left "
                            f"(truncated or damaged header)")
        self.pos += n

    def scalar(self, code: str, size: int, what: str):
        start = self.pos
        self.skip(size, what)
        return struct.unpack_from("<" + code, self.buf, start)[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", 8, what)

    def string(self, what: str, cap: int | None = None) -> bytes:
        n = self.u64(f"the length of {what}")
        if cap is not None and n > cap:
            raise self.fail(f"{what} is {n} bytes long (at most {cap})")
        start = self.pos
        self.skip(n, what)
        return self.buf[start:self.pos]

    def text(self, what: str, cap: int | None = None) -> str:
        raw = self.string(what, cap)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} {raw[:40]!r} is not UTF-8") from None

    def array(self, dtype: str, count: int, what: str) -> list:
        start = self.pos
        self.skip(count * np.dtype(dtype).itemsize, what)
        return np.frombuffer(self.buf, dtype, count, start).tolist()


def scan_header(path) -> Header:
    """Check the header of one GGUF file without trusting any count in it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ModelFormatError(f"{path}: not a readable GGUF file ({size} bytes: too short for a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan_fields(_Cursor(buf, path))
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _scan_fields(c: _Cursor) -> Header:
    if bytes(c.buf[:4]) != MAGIC:
        raise c.fail(f"GGUF magic invalid: the file starts with {bytes(c.buf[:4])!r}, not {MAGIC!r}")
    c.pos = 4
    version = c.u32("the version")
    if version & 0xFFFF == 0 and version:  # 3 written big-endian reads as 3 << 24
        raise c.fail("big-endian GGUF (written for s390x); convert reads little-endian files")
    if version not in VERSIONS:
        raise c.fail(f"version {version}; supported: {', '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
    # Each entry needs a minimum number of bytes: a claim the file cannot hold is refused before
    # anything loops over it.
    _claim(c, n_kv, MIN_ITEM[0] + 12, MAX_KV, "metadata entries")
    _claim(c, n_tensors, 8 + 4 + 8 + 4 + 8, MAX_TENSORS, "tensors")
    metadata, items = {}, [0]
    for i in range(n_kv):
        key = c.text(f"metadata key #{i}", MAX_KEY)
        if key in metadata:
            raise c.fail(f"metadata key {key!r} appears twice")
        vtype = c.u32(f"the type of {key}")
        if key == "general.alignment" and vtype != UINT32:
            raise c.fail(f"general.alignment has value type {vtype}, not UINT32")
        metadata[key] = _value(c, key, vtype, 0, items)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise c.fail(f"general.alignment = {alignment}: must be a power of two")
    tensors = [_tensor_info(c, i) for i in range(n_tensors)]
    data_offset = -(-c.pos // alignment) * alignment
    _check_tensor_bytes(c, tensors, alignment, data_offset)
    return Header(version, alignment, data_offset, tuple(tensors), metadata)


def _claim(c: _Cursor, count: int, min_bytes: int, cap: int, what: str) -> None:
    if count > cap:
        raise c.fail(f"the header claims {count} {what} (at most {cap})")
    if count * min_bytes > c.left():
        raise c.fail(f"the header claims {count} {what}, more than the {c.left()} bytes left can hold "
                     f"(truncated or damaged header)")


def _value(c: _Cursor, key: str, vtype: int, depth: int, items: list[int]):
    """One value; `depth` > 0 inside an array (strings there decode leniently)."""
    if vtype in SCALARS:
        v = c.scalar(*SCALARS[vtype], f"the value of {key}")
        # The shortest decimal that is this float32: what the converter was given.
        return float(str(np.float32(v))) if vtype == FLOAT32 and depth == 0 else v
    if vtype == STRING:
        if depth:
            return c.string(f"an item of {key}").decode("utf-8", errors="replace")
        return c.text(f"the value of {key}")
    if vtype == ARRAY:
        if depth >= MAX_DEPTH:
            raise c.fail(f"{key}: arrays nested deeper than {MAX_DEPTH}")
        itype = c.u32(f"the item type of {key}")
        if itype not in MIN_ITEM:
            raise c.fail(f"{key}: unknown array item type {itype}")
        count = c.u64(f"the item count of {key}")
        if count * MIN_ITEM[itype] > c.left():
            raise c.fail(f"{key}: the array claims {count} items, more than the {c.left()} bytes left can hold "
                         f"(truncated or damaged header)")
        items[0] += count
        if items[0] > MAX_ARRAY_ITEMS:
            raise c.fail(f"{key}: the metadata arrays hold {items[0]} items in all (at most {MAX_ARRAY_ITEMS})")
        if itype in SCALARS:
            values = c.array(NP_TYPES[itype], count, f"the items of {key}")
            return [bool(v) for v in values] if itype == BOOL else values
        return [_value(c, key, itype, depth + 1, items) for _ in range(count)]
    raise c.fail(f"{key}: unknown value type {vtype}")


def _tensor_info(c: _Cursor, i: int) -> TensorEntry:
    name = c.text(f"tensor name #{i}", MAX_TENSOR_NAME)
    n_dims = c.u32(f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise c.fail(f"tensor {name!r} has {n_dims} dimensions (ggml tensors have 1 to {MAX_DIMS})")
    dims = tuple(c.u64(f"the dims of {name!r}") for _ in range(n_dims))
    if any(not 1 <= d <= MAX_DIM for d in dims):
        raise c.fail(f"tensor {name!r} has dims {list(dims)}: each must be in [1, 2^63)")
    raw_type = c.u32(f"the type of {name!r}")
    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise c.fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
    if dims[0] % block:
        raise c.fail(f"tensor {name!r}: its first dim {dims[0]} is not a whole number of "
                     f"{ggml_type.name} blocks of {block}")
    offset = c.u64(f"the offset of {name!r}")
    numel = 1
    for d in dims:
        numel *= d  # Python integers: no wrap past 2^64
    return TensorEntry(name, dims, raw_type, offset, numel // block * type_size)


def _check_tensor_bytes(c: _Cursor, tensors: list[TensorEntry], alignment: int, data_offset: int) -> None:
    names: set[str] = set()
    data_size = c.size - data_offset
    for t in tensors:
        if t.name in names:
            raise c.fail(f"tensor {t.name!r} appears twice")
        names.add(t.name)
        if t.offset % alignment:
            raise c.fail(f"tensor {t.name!r} starts at data offset {t.offset}, not a multiple of the "
                         f"alignment {alignment}")
        if t.offset + t.nbytes > data_size:
            raise c.fail(f"tensor {t.name!r} ({t.nbytes} bytes at data offset {t.offset}) runs past the end "
                         f"of the file (data section of {max(data_size, 0)} bytes; truncated download?)")
    by_start = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(by_start, by_start[1:]):
        if b.offset < a.offset + a.nbytes:
            raise c.fail(f"tensor {b.name!r} (data offset {b.offset}) overlaps tensor {a.name!r} "
                         f"(data offsets {a.offset} to {a.offset + a.nbytes})")
