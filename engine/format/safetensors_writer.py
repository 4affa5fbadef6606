"""Streaming safetensors writer: the header is planned up front, tensors are written one at a time.

A whole shard never sits in memory. The header is computed from the planned (name, dtype, shape)
list before any data exists, so each tensor can be written as soon as it is generated.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from engine.base.config import atomic_write_text
from engine.base.dtypes import FLOAT_NAMES, ITEMSIZE, TAG_OF, torch_dtype

# The floats the writer writes: safetensors tag, element size, and how the bytes are
# reinterpreted for numpy (which has no bf16).
DTYPES: dict[str, tuple[str, int, torch.dtype]] = {
    name: (TAG_OF[name], ITEMSIZE[name], torch.int16 if name == "bfloat16" else torch_dtype(name))
    for name in (*FLOAT_NAMES, "int8", "uint8")}  # integers: MXFP4 blocks/scales, quantized containers (engine/format/container.py)

# Data starts on a 4 KiB boundary so O_DIRECT readers can address the first tensor without
# straddling the header; the JSON header is padded with spaces, which the format allows.
DATA_ALIGN = 4096


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # key of DTYPES

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


def build_header(specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """8-byte little-endian length + JSON header, padded so the data section is DATA_ALIGN-aligned."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for s in specs:
        header[s.name] = {
            "dtype": DTYPES[s.dtype][0],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = (-(8 + len(raw))) % DATA_ALIGN
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one .safetensors file whose tensors arrive in planned order.

    Usage: `with ShardWriter(path, specs) as w: for t in tensors: w.write(name, t)`.
    Refuses out-of-order names, wrong shapes or a short file, so a bug cannot produce a file
    whose header lies about its contents.
    """

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = list(specs)
        self.metadata = metadata
        self._next = 0
        self._f: BinaryIO | None = None
        self._scratch: torch.Tensor | None = None

    def __enter__(self) -> "ShardWriter":
        self._f = open(self.path, "wb")
        self._header = build_header(self.specs, self.metadata)
        self._f.write(self._header)
        return self

    def restamp(self, metadata: dict[str, str]) -> None:
        """Replace the metadata once the data is written (e.g. a checksum of what went in).

        The new header must have the same length, so fields known only at the end are planned
        with same-length placeholders; the data offsets cannot move.
        """
        header = build_header(self.specs, metadata)
        if len(header) != len(self._header):
            raise ValueError(f"{self.path.name}: restamped header changes length")
        self.metadata, self._header = metadata, header

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write the next planned tensor; returns the number of data bytes written."""
        assert self._f is not None, "ShardWriter used outside its context"
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path.name}: unplanned tensor {name}")
        spec = self.specs[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path.name}: expected {spec.name}{list(spec.shape)}, got {name}{list(tensor.shape)}"
            )
        self._write_data(spec, tensor)
        self._next += 1
        return spec.nbytes

    def write_rows(self, name: str, chunks) -> int:
        """Write the next planned tensor from consecutive slices along its first dimension, so a
        large tensor (a layer's fused experts) never has to exist whole in memory."""
        assert self._f is not None, "ShardWriter used outside its context"
        if self._next >= len(self.specs) or self.specs[self._next].name != name:
            raise ValueError(f"{self.path.name}: unplanned tensor {name}")
        spec, rows = self.specs[self._next], 0
        for chunk in chunks:
            if tuple(chunk.shape[1:]) != tuple(spec.shape[1:]) or rows + chunk.shape[0] > spec.shape[0]:
                raise ValueError(f"{self.path.name}: {name}{list(spec.shape)} got a slice {list(chunk.shape)} "
                                 f"after {rows} rows")
            self._write_data(spec, chunk)
            rows += chunk.shape[0]
        if rows != spec.shape[0]:
            raise ValueError(f"{self.path.name}: {name}{list(spec.shape)} got {rows} rows")
        self._next += 1
        return spec.nbytes

    def _write_data(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:  # no bytes to write (memoryview cannot cast a view with a 0 in its shape)
            return
        view_dtype = DTYPES[spec.dtype][2]
        target = torch_dtype(spec.dtype)
        if tensor.dtype == target:
            t = tensor.contiguous()
        else:
            # Convert into a reused buffer: fresh allocations per tensor cost page faults.
            n = tensor.numel()
            if self._scratch is None or self._scratch.dtype != target or self._scratch.numel() < n:
                self._scratch = torch.empty(n, dtype=target)
            t = self._scratch[:n].view(tensor.shape)
            t.copy_(tensor)
        # Reinterpret (no copy) as a dtype numpy knows; bf16 goes out as its raw 16-bit words.
        arr = t.view(view_dtype).numpy()
        if sys.byteorder != "little":  # the format is little-endian on every host
            arr = arr.byteswap()
        self._f.write(memoryview(arr).cast("B"))

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._f is not None
        try:
            if exc_type is None:
                if self._next != len(self.specs):
                    missing = self.specs[self._next].name
                    raise ValueError(f"{self.path.name}: closed before writing {missing}")
                self._f.seek(0)
                self._f.write(self._header)
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()


def write_json_atomic(path: Path, obj) -> None:
    """JSON file written to a temp name in the same directory, fsynced, then renamed."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_header(path: Path) -> dict:
    """Tensor entries of a safetensors file we wrote (no validation: the engine's checkpoint reader does that)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header
