"""Hugging Face model directory → an index of every tensor's file, byte range, dtype and shape.

Nothing here trusts the files: a safetensors header is validated completely (length, JSON,
dtypes, shapes against byte ranges, ranges inside the file, no overlaps) before any tensor
byte is read, so a truncated or hostile file fails with one clear line instead of a crash
or a read of garbage.

safetensors layout: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data;
offsets are relative to the start of the data (8 + N).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.base import heap
from engine.base.dtypes import safetensors_dtypes
from engine.base.errors import ModelFormatError
from engine.base.inputs import LIMITS, open_input, printable
from engine.base.jsonlimits import load_json_input, loads_limited
from engine.format.tensor_checks import check_dtypes
from engine.arch.registry import validate_config

# safetensors dtype tag → (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = safetensors_dtypes()

# A real header is a few MB at most (DeepSeek-V3 shards: < 1 MB); the safetensors library caps it
# at 100 MB too. Refusing absurd lengths up front stops a hostile file from making us allocate
# gigabytes for "JSON".
MAX_HEADER_BYTES = 100_000_000
# {name: {"shape": [...]}} is three levels; anything deeper is not a safetensors header, and
# checking before parsing keeps a "[[[[...]]]]" bomb away from the recursive JSON parser.
MAX_HEADER_DEPTH = 3
# config.json and the shard index: small files; their caps are engine/base/inputs.py's LIMITS.
MAX_CONFIG_BYTES = LIMITS["config.json"]
MAX_INDEX_BYTES = LIMITS["safetensors index"]


@dataclass(frozen=True, slots=True)  # slots: ~90k of them at DeepSeek-V3 scale, no __dict__ each
class TensorInfo:
    name: str
    path: str  # absolute path of the shard
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header. Reads only the header."""
    path = str(path)
    fd, file_size = open_input(path, "safetensors shard", ModelFormatError)
    try:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise ModelFormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        header_len = int.from_bytes(prefix, "little")
        if header_len > file_size - 8:
            raise ModelFormatError(
                f"{path}: safetensors header length {header_len} is larger than the file "
                f"({file_size} bytes): truncated or corrupt")
        if header_len > MAX_HEADER_BYTES:
            raise ModelFormatError(f"{path}: safetensors header length {header_len} is implausibly large")
        raw = os.pread(fd, header_len, 8)
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) < header_len:
        raise ModelFormatError(f"{path}: truncated inside the safetensors header")
    # unique_keys: a header naming a tensor twice would otherwise load whichever entry came last.
    header = loads_limited(raw, f"{path}: safetensors header", max_bytes=MAX_HEADER_BYTES,
                           max_depth=MAX_HEADER_DEPTH, unique_keys=True)
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: safetensors header is not a JSON object")

    data_start = 8 + header_len
    data_size = file_size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ModelFormatError(f"{path}: __metadata__ must be an object of strings")
            continue
        infos[name] = _validate_entry(path, name, entry, data_start, data_size)
    _check_no_overlap(path, infos)
    return infos


def _validate_entry(path: str, name: str, entry, data_start: int, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelFormatError(f"{where}: header entry is not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ModelFormatError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ModelFormatError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ModelFormatError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ModelFormatError(f"{where}: data_offsets {offsets} are not an increasing range")
    if end > data_size:
        raise ModelFormatError(
            f"{where}: data_offsets end {end} is beyond the file's data ({data_size} bytes): "
            "truncated shard or corrupt header")
    expected = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != expected:
        raise ModelFormatError(
            f"{where}: shape {shape} of {dtype} needs {expected} bytes but data_offsets span {end - begin}")
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_no_overlap(path: str, infos: dict[str, TensorInfo]) -> None:
    ordered = sorted((i for i in infos.values() if i.nbytes), key=lambda i: i.offset)
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.offset < prev.end:
            raise ModelFormatError(f"{path}: tensors {prev.name!r} and {cur.name!r} overlap")


class Checkpoint:
    """A validated Hugging Face model directory: config.json plus the index of all tensors."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ModelFormatError(f"model directory {str(self.directory)!r} does not exist")
        self.config = load_config_json(self.directory)
        # Config first: a bad field is reported before any shard is opened.
        validate_config(self.config, str(self.directory / "config.json"))
        self.tensors = self._index_tensors()
        check_dtypes(self.tensors, self.config)

    def _index_tensors(self) -> dict[str, TensorInfo]:
        index_path = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if os.path.lexists(index_path):
            index = load_json_input(index_path, "safetensors index", unique_keys=True)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelFormatError(f"{index_path}: not a valid safetensors index "
                                       "(needs a weight_map object of tensor name → shard file name)")
            # Names grouped by shard in one pass: matching every name against every shard is
            # shards x tensors (DeepSeek-V3: 163 x 91k = 15M steps, seconds of the open time).
            names_of: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                names_of.setdefault(file, []).append(name)
            tensors: dict[str, TensorInfo] = {}
            seen_in: dict[str, Path] = {}
            for shard in sorted(names_of):
                shard_path = self.directory / str(shard)
                if Path(str(shard)).name != str(shard):
                    raise ModelFormatError(f"{index_path}: shard name {shard!r} is not a plain file name")
                if not os.path.lexists(shard_path):
                    raise ModelFormatError(f"{index_path}: shard {shard!r} is missing")
                infos = read_safetensors_header(shard_path)
                _check_not_in_two_shards(seen_in, shard_path, infos)
                for name in names_of[shard]:
                    if name not in infos:
                        raise ModelFormatError(f"{shard_path}: tensor {name!r} listed in the index is missing")
                    tensors[name] = infos[name]
            return tensors
        if os.path.lexists(single):
            return read_safetensors_header(single)
        raise ModelFormatError(
            f"{self.directory}: no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.directory}: missing tensor {name!r}") from None

    def load(self, name: str, dtype: torch.dtype | None = None, alloc=None) -> torch.Tensor:
        """Read one tensor into memory (buffered pread), optionally casting it. `alloc(nbytes)`, if
        given, makes the uint8 storage of the result (the runtime's huge-page arena)."""
        info = self.info(name)
        if dtype is None or info.torch_dtype == dtype:
            return read_tensor(info, alloc)
        tensor = read_tensor(info)
        if alloc is None:
            return tensor.to(dtype)
        out = alloc(tensor.numel() * dtype.itemsize).view(dtype).view(tensor.shape)
        return out.copy_(tensor)

    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())


def _check_not_in_two_shards(seen_in: dict[str, Path], shard: Path, infos: dict[str, TensorInfo]) -> None:
    """A tensor stored in two shards is refused: which copy is "the" weight would depend on
    which shard the index happens to name, and a converter or a hostile file could make the two
    differ."""
    for name in infos:
        other = seen_in.setdefault(name, shard)
        if other != shard:
            raise ModelFormatError(f"{shard}: tensor {printable(name)!r} is also in {other.name}: "
                                   "duplicate tensor names across shards")


def read_tensor(info: TensorInfo, alloc=None) -> torch.Tensor:
    """One tensor read straight into its storage (no intermediate bytes object): a new one, or
    `alloc(nbytes)`'s uint8 tensor."""
    raw = torch.empty(info.nbytes, dtype=torch.uint8) if alloc is None else alloc(info.nbytes)
    try:
        with open(info.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [raw.numpy()], info.offset) if info.nbytes else 0
    except OSError as exc:
        raise ModelFormatError(f"{info.path}: cannot read tensor {info.name!r}: {exc.strerror or exc}") from None
    if got != info.nbytes:
        raise ModelFormatError(f"{info.path}: truncated while reading tensor {info.name!r}")
    return raw.view(info.torch_dtype).reshape(info.shape)


def same_bytes(a: TensorInfo, b: TensorInfo) -> bool:
    """Whether two stored tensors are one tensor twice: the same dtype, shape and bytes (read in
    chunks of a MiB, so a vocabulary-sized head costs no more memory than that). A file that carries a
    copy of a shared tensor (DeepSeek-V3's MTP head) then loads it once. The answer is kept while
    the files are the same files (inode, size, modification time): the plan and the load both ask."""
    if a.dtype != b.dtype or a.shape != b.shape or a.nbytes != b.nbytes:
        return False
    try:
        stamps = tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in (os.stat(a.path), os.stat(b.path)))
    except OSError as exc:
        raise ModelFormatError(f"{a.path}: cannot compare {a.name!r} with {b.name!r}: {exc.strerror or exc}") from None
    return _same_bytes(a, b, stamps)


@functools.lru_cache(maxsize=16)
def _same_bytes(a: TensorInfo, b: TensorInfo, _stamps: tuple, chunk: int = 1 << 20) -> bool:
    # Plain byte buffers compared by memcmp, not torch tensors: the plan measures the process's resident
    # set next, and torch.equal's first call paged 1.25 MiB of torch's code into it (three expert-cache
    # entries of the MTP reference at 368 MiB)
    size = min(chunk, a.nbytes)
    left, right = bytearray(size), bytearray(size)
    try:
        with open(a.path, "rb", buffering=0) as fa, open(b.path, "rb", buffering=0) as fb:
            for at in range(0, a.nbytes, chunk):
                n = min(chunk, a.nbytes - at)
                if (os.preadv(fa.fileno(), [memoryview(left)[:n]], a.offset + at) != n
                        or os.preadv(fb.fileno(), [memoryview(right)[:n]], b.offset + at) != n):
                    raise ModelFormatError(f"{a.path}: truncated while comparing {a.name!r} with {b.name!r}")
                if (left != right) if n == size else (left[:n] != right[:n]):
                    return False
    except OSError as exc:
        raise ModelFormatError(f"{a.path}: cannot compare {a.name!r} with {b.name!r}: {exc.strerror or exc}") from None
    finally:
        del left, right
        heap.release_freed()  # no freed chunk in the resident set the plan reads
    return True


def load_config_json(directory: Path) -> dict:
    path = directory / "config.json"
    if not os.path.lexists(path):
        raise ModelFormatError(f"{directory}: config.json is missing")
    config = load_json_input(path, "config.json")
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path}: not a JSON object")
    return config
