"""Open a GGUF file, or the parts of a split one, and check it before anything is converted.

Each part's header is parsed by header.py, which bounds every count, dim and offset against
the file before it allocates anything by them (gguf-py's GGUFReader, used before, trusted them:
issue 37); the tensor data is then memory-mapped here, in the layout gguf-py's reader gives
(float arrays for F32/F16, uint8 rows of blocks otherwise), which dequant.py expects. On top of
that this checks that the parts of a split model are all present and agree on their count, and
that no tensor name appears twice across the parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from engine.base.errors import ModelFormatError
from engine.format.gguf.header import Header, scan_header

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class GGUFTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (GGUF's ne reversed)
    data: np.ndarray  # memory-mapped: float array, or uint8 rows of blocks for quantized types
    path: Path

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


def split_paths(path: Path) -> list[Path]:
    """All parts of a split model given any one of them (or the file itself when not split)."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1:
        raise ModelFormatError(f"{path}: split count is 0")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFormatError(f"{path}: split model is missing part(s) {', '.join(missing)}")
    return parts


# ggml types memory-mapped as typed arrays (as gguf-py's reader does); the rest as uint8 block rows.
TYPED = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
         GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
         GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
         GGMLQuantizationType.I64: np.int64}


class GGUFModel:
    """The metadata of the first part and the tensors of all parts, by GGUF name."""

    def __init__(self, path):
        path = Path(path)
        if not path.is_file():
            raise ModelFormatError(f"{path}: not a file")
        self.paths = split_paths(path)
        self.metadata: dict = {}
        self.tensors: dict[str, GGUFTensor] = {}
        self.header_sizes: dict[Path, int] = {}  # bytes before each part's tensor data (its identity)
        for i, part in enumerate(self.paths):
            header = scan_header(part)
            self.header_sizes[part] = header.data_offset
            meta = header.metadata
            if len(self.paths) > 1:
                count = meta.get("split.count")
                if count is not None and count != len(self.paths):
                    raise ModelFormatError(f"{part}: split.count says {count} parts, the file names say "
                                           f"{len(self.paths)}")
            if i == 0:
                self.metadata = meta
            self._add_tensors(header, part)
        if "general.architecture" not in self.metadata:
            raise ModelFormatError(f"{self.paths[0]}: no general.architecture in the GGUF metadata")

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])

    def _add_tensors(self, header: Header, part: Path) -> None:
        if not header.tensors:
            return
        mm = np.memmap(part, mode="r")  # header.py checked every tensor's bytes lie inside it
        for t in header.tensors:
            if t.name in self.tensors:
                raise ModelFormatError(f"{part}: tensor {t.name!r} also appears in {self.tensors[t.name].path.name}")
            ggml_type = GGMLQuantizationType(t.ggml_type)
            shape = tuple(reversed(t.dims))  # torch order
            start = header.data_offset + t.offset
            raw = mm[start:start + t.nbytes]
            if ggml_type in TYPED:
                data = raw.view(TYPED[ggml_type]).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
            self.tensors[t.name] = GGUFTensor(t.name, ggml_type, shape, data, part)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            raise ModelFormatError(f"{self.paths[0]}: GGUF metadata has no {full}")
        return self.metadata[full]
