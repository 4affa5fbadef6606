"""A tiny qwen3_moe model written by synth (no transformers import): a fraction of a MB, in well under a second."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from engine import synth

# 2 layers of the tiny preset in one file: every header mutation then lands in the one shard the
# engine reads; `sharded=True` keeps the preset's small shards (and the index) instead.
TINY = {**synth.load_preset("tiny"), "num_hidden_layers": 2}
RUN_ARGS = ("--prompt-tokens", "3", "--max-new-tokens", "2", "--ctx-size", "16")


def make_tiny(out: Path, sharded: bool = False, **overrides) -> Path:
    geometry = {**TINY, **({} if sharded else {"max_shard_size": 1 << 30}), **overrides}
    return synth.synthesize(geometry, out, progress=False)


def read_header(path: Path) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path: Path, header, data: bytes, length: int | None = None) -> None:
    """Write `header` (anything JSON-serialisable, or raw bytes) before `data`; `length` overrides the prefix."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)
