"""JSON from files we do not trust: a size limit and a nesting-depth limit checked before parsing.

Python's json parser recurses once per nesting level, so `[[[[...]]]]` a few thousand deep
raises RecursionError — a traceback, not an error message — and a huge "JSON" blob makes us
allocate it all first. Every JSON file the engine or tuner reads from a user (config.json, the
safetensors index and headers, geometry and profile files) goes through `loads_limited`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from engine.base.errors import ColibriError, ModelFormatError

# Real config.json / index / profile files nest 4-6 levels; 64 is generous and far below the
# recursion limit.
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_BYTES = 64 << 20

# A string token (with escapes): removed whole so brackets inside strings do not count; an
# unterminated string is left for the parser to reject. Then everything but brackets goes.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: one step per run of plain characters
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as int8: +1 per opener, -1 per closer


def nesting_depth_exceeds(text: str, max_depth: int) -> bool:
    """True if brackets outside strings nest deeper than max_depth. No recursion.

    Strings, then everything but brackets, are dropped by two regex substitutions, and the depth
    is the running sum of +1 per opener, -1 per closer (numpy): no Python step per token. A
    DeepSeek-V3 shard header is mostly strings, and a match object per string was a third of
    the checkpoint's open time (163 shards, 92k tensors)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    if not brackets:
        return False
    steps = np.frombuffer(brackets.translate(_DEPTH_STEP), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max()) > max_depth


def loads_limited(data: bytes | str, source: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                  max_depth: int = DEFAULT_MAX_DEPTH, error: type[ColibriError] = ModelFormatError) -> Any:
    """Parse JSON after checking its size and nesting; every failure is `error` with one line."""
    if len(data) > max_bytes:
        raise error(f"{source}: {len(data)} bytes is larger than the {max_bytes}-byte limit for this file")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{source}: not valid JSON (not UTF-8 at byte {exc.start})") from None
    if nesting_depth_exceeds(data, max_depth):
        raise error(f"{source}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's int-digits limit
        raise error(f"{source}: not valid JSON ({exc})") from None
    except RecursionError:  # cannot happen after the depth check; kept so it never becomes a traceback
        raise error(f"{source}: JSON nested too deeply") from None
