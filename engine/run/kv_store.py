"""KV on the SSD: the prefix cache's blocks (engine/run/prefix_cache.py) in a bounded directory,
and the one file format they and `run --prompt-cache` share.

A KV file is safetensors: a header (JSON: each tensor's dtype, shape and byte range, and
`__metadata__.colibri_kv`, our own JSON) then the tensors' bytes, written whole to a temp file
and renamed (never half a file under the final name), never pickle. The metadata says what the
KV depends on: the model key (engine version, config.json and every shard's header, compute and
KV dtype, RoPE, routing trim: prefix_cache.model_key), the tokens and their first position,
and the sha256 of the data. A file is used only when all of it is what the request expects and
the checksum holds; otherwise (corrupt, truncated, foreign, stale) it is skipped with one
warning line and its positions are recomputed. A file this store skips is removed: it is in our
directory, under our naming, and would only be skipped again.

The directory holds one model's blocks (`<root>/<model fingerprint>/`), at most `max_bytes`:
before a write the oldest files (by mtime; a restore touches its file) go first. A write that
fails (ENOSPC, a read-only disk) turns the disk tier off with one warning: the server goes on
with RAM only. One process uses a directory at a time (flock); a second one runs RAM-only.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import torch

from engine.base.durable import atomic_write_bytes, atomic_write_text
from engine.base.errors import ModelFormatError
from engine.base.jsonlimits import loads_limited

FORMAT = "colibri-kv/1"
MARKER = ".colibri-kv"  # in the root: {"format": FORMAT}; what the output guard recognises
LOCK = ".lock"
SUFFIX = ".kv.safetensors"
_NAME = re.compile(r"^[0-9a-f]{64}\.kv\.safetensors$")
MAX_HEADER = 64 << 20  # a prompt file's token list is the largest part: 4M tokens at ~8 bytes each
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
          torch.float8_e4m3fn: "F8_E4M3"}
_BY_NAME = {v: k for k, v in DTYPES.items()}


class KVFileError(ModelFormatError):
    """A KV file that must not be used: the reason, in one line."""


def warn(message: str) -> None:
    """One line on stderr: a skipped file or a disk tier turned off is worth knowing, never fatal."""
    print(f"colibri: warning: {message}", file=sys.stderr, flush=True)


def encode(meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """A safetensors file's bytes: tensors in name order, the data's sha256 in the metadata."""
    names = sorted(tensors)
    blobs = [tensors[n].contiguous().view(torch.uint8).numpy().tobytes() for n in names]
    data = b"".join(blobs)
    header, offset = {}, 0
    for name, blob in zip(names, blobs):
        t = tensors[name]
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    meta = {**meta, "format": FORMAT, "sha256": hashlib.sha256(data).hexdigest()}
    header["__metadata__"] = {"colibri_kv": json.dumps(meta, separators=(",", ":"))}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writers do
    return len(text).to_bytes(8, "little") + text + data


def decode(path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None,
           max_bytes: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a KV file, every part checked first: a regular file no larger than
    max_bytes, the header bounded JSON, the tensors exactly `layout` (names, dtypes, shapes; None:
    any of our dtypes), their byte ranges back to back to the end of the file, the checksum."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise KVFileError(f"{path}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not (st.st_mode & 0o170000 == 0o100000):
            raise KVFileError(f"{path}: not a regular file")
        if st.st_size < 8 or st.st_size > max_bytes:
            raise KVFileError(f"{path}: {st.st_size} bytes (a KV file here is 8..{max_bytes})")
        n = int.from_bytes(f.read(8), "little")
        if n > min(MAX_HEADER, st.st_size - 8):
            raise KVFileError(f"{path}: header length {n} does not fit the file (truncated?)")
        header = loads_limited(f.read(n), str(path), max_bytes=MAX_HEADER, error=KVFileError, unique_keys=True,
                               finite=True)
        data = f.read(st.st_size - 8 - n)
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise KVFileError(f"{path}: no safetensors metadata")
    raw = header.pop("__metadata__").get("colibri_kv")
    if not isinstance(raw, str):
        raise KVFileError(f"{path}: not a colibri KV file")
    meta = loads_limited(raw, str(path), max_bytes=MAX_HEADER, error=KVFileError, unique_keys=True, finite=True)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise KVFileError(f"{path}: not a {FORMAT} file")
    if layout is not None and set(header) != set(layout):
        raise KVFileError(f"{path}: holds other tensors than this model's KV cache")
    tensors, spans = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in _BY_NAME:
            raise KVFileError(f"{path}: tensor {name!r} has no dtype we write")
        dtype, shape, span = _BY_NAME[entry["dtype"]], entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
                or not isinstance(span, list) or len(span) != 2 or not all(type(o) is int for o in span)):
            raise KVFileError(f"{path}: tensor {name!r} has a malformed shape or byte range")
        if layout is not None and layout[name] != (dtype, tuple(shape)):
            raise KVFileError(f"{path}: tensor {name!r} is {entry['dtype']} {shape}, this model's KV "
                              f"is {DTYPES.get(layout[name][0])} {list(layout[name][1])}")
        numel = 1
        for d in shape:
            numel *= d
        if span[1] - span[0] != numel * dtype.itemsize:
            raise KVFileError(f"{path}: tensor {name!r}'s byte range does not match its shape")
        spans.append((span[0], span[1], name, dtype, tuple(shape)))
    spans.sort()
    end = 0
    for begin, stop, *_ in spans:
        if begin != end:
            raise KVFileError(f"{path}: tensors overlap or leave gaps")
        end = stop
    if end != len(data):
        raise KVFileError(f"{path}: {len(data)} data bytes where the header says {end} (truncated?)")
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise KVFileError(f"{path}: checksum mismatch (corrupt)")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    for begin, stop, name, dtype, shape in spans:
        tensors[name] = buf[begin:stop].view(dtype).reshape(shape)
    return meta, tensors


def write_file(path: Path, data: bytes) -> None:
    """temp + fsync + rename (a seam the full-disk test replaces)."""
    atomic_write_bytes(path, data)


def is_kv_root(directory: Path) -> bool:
    """The output guard's recogniser: a directory this module made (its marker names our format)."""
    try:
        data = loads_limited((Path(directory) / MARKER).read_bytes()[:4096], "marker", max_bytes=4096)
    except (OSError, ModelFormatError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def is_kv_file(path: Path) -> bool:
    """The output guard's recogniser for `run --prompt-cache FILE`: a previous KV file of ours."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return 0 < n <= MAX_HEADER and b'"colibri_kv"' in f.read(min(n, 4096))
    except OSError:
        return False


class KVStore:
    """The model's directory of KV blocks, bounded by max_bytes. `enabled` goes False for good
    after a failed write or when another process holds the directory."""

    def __init__(self, root: Path, fingerprint: str, max_bytes: int):
        self.root, self.max_bytes = Path(root), max_bytes
        self.dir = self.root / fingerprint[:32]
        self.enabled, self.spilled_bytes, self.read_bytes, self.skipped = max_bytes > 0, 0, 0, 0
        self._lock_fd = None
        self._sizes: dict[str, tuple[int, float]] = {}  # name → (bytes, mtime)
        # Their sum, kept as files come and go: /metrics reads it from another thread.
        self.used_bytes = 0
        if self.enabled:
            try:
                self._open()
            except OSError as exc:
                self._off(f"KV directory {self.dir}: {exc.strerror or exc}")

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not is_kv_root(self.root):
            atomic_write_text(self.root / MARKER, json.dumps({"format": FORMAT}) + "\n")
        fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._off(f"KV directory {self.dir} is in use by another process; KV stays in RAM only")
            return
        self._lock_fd = fd
        for entry in os.scandir(self.dir):
            if entry.name.startswith(".") and entry.name.endswith(".tmp") and SUFFIX in entry.name:
                os.unlink(entry.path)  # a write a crash interrupted (ours: atomic_write_bytes' temp name)
            elif _NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                self._sizes[entry.name] = (st.st_size, st.st_mtime)
                self.used_bytes += st.st_size

    def _off(self, message: str) -> None:
        if self.enabled:
            warn(message)
        self.enabled = False

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return self.enabled and f"{key}{SUFFIX}" in self._sizes

    def put(self, key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> bool:
        """Write one block unless it is there already; evict the oldest to stay within the bound."""
        if not self.enabled:
            return False
        name = f"{key}{SUFFIX}"
        if name in self._sizes:
            return True
        data = encode(meta, tensors)
        if len(data) > self.max_bytes:
            return False
        for old, _ in sorted(self._sizes.items(), key=lambda kv: kv[1][1]):
            if self.used_bytes + len(data) <= self.max_bytes:
                break
            self._remove(old)
        try:
            write_file(self.dir / name, data)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self._off(f"cannot write KV to {self.dir} ({'disk full' if full else exc.strerror or exc}); "
                      "KV stays in RAM only")
            return False
        self._sizes[name] = (len(data), os.stat(self.dir / name).st_mtime)
        self.used_bytes += len(data)
        self.spilled_bytes += len(data)
        return True

    def get(self, key: str, expect: dict, layout: dict) -> dict[str, torch.Tensor] | None:
        """The block's tensors when its file is all that `expect` says (metadata) and `layout`
        (tensors); None when absent; skipped (one warning, the file removed) when not."""
        name = f"{key}{SUFFIX}"
        if not self.enabled or name not in self._sizes:
            return None
        path = self.dir / name
        try:
            meta, tensors = decode(path, layout, self.max_bytes)
            wrong = [k for k, v in expect.items() if meta.get(k) != v]
            if wrong:
                raise KVFileError(f"{path}: written for another {' / '.join(wrong)} (foreign or stale)")
        except KVFileError as exc:
            warn(f"KV file skipped, its tokens are recomputed: {exc}")
            self.skipped += 1
            self._remove(name)
            return None
        try:
            os.utime(path)  # the bound evicts by mtime: a restored block is recent again
            self._sizes[name] = (self._sizes[name][0], os.stat(path).st_mtime)
        except OSError:
            pass
        self.read_bytes += self._sizes[name][0]
        return tensors

    def _remove(self, name: str) -> None:
        size, _ = self._sizes.pop(name, (0, 0.0))
        self.used_bytes -= size
        try:
            os.unlink(self.dir / name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
