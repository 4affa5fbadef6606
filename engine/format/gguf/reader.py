"""Open a GGUF file, or the parts of a split one, and check it before anything is converted.

Each part's header is first scanned by header.py, which bounds every count, dim and offset
against the file (gguf-py trusts them and allocates by them); only then does gguf-py's
GGUFReader parse it and memory-map the tensor data. Whatever numpy still raises on a damaged
file (IndexError, ValueError, ...) is turned into one ModelFormatError line naming the file. On
top of that this checks that the parts of a split model are all present and agree on their
count, and that no tensor name appears twice across the parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from engine.base.errors import ModelFormatError
from engine.format.gguf.header import scan_header

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


def _value(field):
    """A metadata value as plain Python (str, int, float, bool, or a list of them)."""
    if field.types and field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
        # Token strings are bytes in the file; decode leniently (a vocab may hold partial UTF-8).
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # The shortest decimal that is this float32 (1e-06, not 9.999999974752427e-07): what the
        # converter was given.
        return float(str(np.float32(value)))
    return value


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
            reader = _open(part)
            self.header_sizes[part] = int(reader.data_offset)
            meta = {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            if len(self.paths) > 1:
                count = meta.get("split.count")
                if count is not None and count != len(self.paths):
                    raise ModelFormatError(f"{part}: split.count says {count} parts, the file names say "
                                           f"{len(self.paths)}")
            if i == 0:
                self.metadata = meta
            self._add_tensors(reader, part)
        if "general.architecture" not in self.metadata:
            raise ModelFormatError(f"{self.paths[0]}: no general.architecture in the GGUF metadata")

    @property
    def arch(self) -> str:
        return str(self.metadata["general.architecture"])

    def _add_tensors(self, reader: GGUFReader, part: Path) -> None:
        size = part.stat().st_size
        for t in reader.tensors:
            if t.name in self.tensors:
                raise ModelFormatError(f"{part}: tensor {t.name!r} also appears in {self.tensors[t.name].path.name}")
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ModelFormatError(f"{part}: tensor {t.name!r} runs past the end of the file "
                                       f"(truncated download?)")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, t.data, part)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default=None):
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            raise ModelFormatError(f"{self.paths[0]}: GGUF metadata has no {full}")
        return self.metadata[full]


def _open(part: Path) -> GGUFReader:
    scan_header(part)  # counts, dims and offsets bounded before gguf-py allocates by them
    try:
        reader = GGUFReader(part, "r")
    except ModelFormatError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError, OSError) as exc:
        raise ModelFormatError(f"{part}: not a readable GGUF file ({_reason(exc)})") from None
    return reader


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    # numpy's complaint about a short buffer is what a truncated file looks like from inside.
    if isinstance(exc, (IndexError, ValueError)) and ("buffer" in text or "reshape" in text or "out of bounds" in text
                                                     or "index" in text):
        return f"truncated or damaged header: {text}"
    if "is not a valid GGMLQuantizationType" in text:
        return f"unknown tensor type: {text}"
    return text
