"""JSON from files we do not trust: a size limit and a nesting-depth limit checked before parsing.

Python's json parser recurses once per nesting level, so `[[[[...]]]]` a few thousand deep
raises RecursionError — a traceback, not an error message — and a huge "JSON" blob makes us
allocate it all first. Every JSON file the engine or tuner reads from a user (config.json, the
safetensors index and headers, geometry and profile files) goes through `loads_limited`, and
every JSON Lines file (prompts, tokenized workloads) through `json_lines`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from engine.base.errors import ColibriError, ModelFormatError
from engine.base.inputs import LIMITS, printable, read_input

# Real config.json / index / profile files nest 4-6 levels; 64 is generous and far below the
# recursion limit.
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_BYTES = 64 << 20

# A string token (with escapes): removed whole so brackets inside strings do not count; an
# unterminated string is left for the parser to reject. Then everything but brackets goes.
# The quantifiers are possessive (`++`, `*+`, Python 3.11+): `(?:[^"\\]|\\.)*` made the regex
# engine keep a backtracking record per character of a string (~120 bytes each, so a 50 MB
# "description" cost 6 GB), and the unrolled `[^"\\]*(?:\\.[^"\\]*)*` still keeps one per escape;
# a possessive repeat never backtracks and keeps none (tests/test_input_limits.py measures it).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
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
                  max_depth: int = DEFAULT_MAX_DEPTH, error: type[ColibriError] = ModelFormatError,
                  unique_keys: bool = False, finite: bool = False) -> Any:
    """Parse JSON after checking its size and nesting; every failure is `error` with one line.

    unique_keys: refuse an object that names a key twice. json keeps the last value silently,
    so a safetensors header or index listing a tensor twice would load whichever came last.
    finite: refuse NaN, Infinity and -Infinity (not JSON, but Python's parser takes them).
    """
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
        return json.loads(data, object_pairs_hook=_unique if unique_keys else None,
                          parse_constant=_no_constant if finite else None)
    except StrictRefusal as exc:
        raise error(f"{source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python's int-digits limit
        raise error(f"{source}: not valid JSON ({exc})") from None
    except RecursionError:  # cannot happen after the depth check; kept so it never becomes a traceback
        raise error(f"{source}: JSON nested too deeply") from None


class StrictRefusal(ValueError):  # a duplicate key or a non-finite constant
    pass


def _no_constant(name: str):
    raise StrictRefusal(f"{name} is not valid JSON (numbers must be finite)")


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise StrictRefusal(f"duplicate key {printable(dup)!r} (an object names it twice)")
    return out


def load_json_input(path, kind: str, *, error: type[ColibriError] = ModelFormatError,
                    max_depth: int = DEFAULT_MAX_DEPTH, unique_keys: bool = False) -> Any:
    """A user's JSON file of this kind (engine/base/inputs.py: regular file, size cap), parsed with the limits."""
    raw = read_input(path, kind, error)
    return loads_limited(raw, str(path), max_bytes=LIMITS[kind], max_depth=max_depth, error=error,
                         unique_keys=unique_keys)


# A JSON Lines line is one request or record: a prompt object nests 1 level, a workload's 2.
LINE_MAX_DEPTH = 16


def split_lines(text: str) -> list[tuple[int, str]]:
    """(1-based number, line) of each non-blank line, split at "\n" only (a "\r" before it goes).

    Not str.splitlines: that also splits at U+2028, U+2029, U+0085 and form feeds, which JSON
    allows raw inside a string, so a valid JSON Lines record holding one was cut in two and
    refused as "not JSON"; and a line number must be one an editor shows."""
    return [(i, line.removesuffix("\r")) for i, line in enumerate(text.split("\n"), 1) if line.strip()]


def json_lines(lines: list[tuple[int, str]], source: str, *, error: type[ColibriError] = ModelFormatError,
               max_depth: int = LINE_MAX_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> list:
    """Each (number, line) of a JSON Lines file parsed with the limits (depth, size — the file's
    own cap, passed by its reader —, finite numbers, unique keys): a line nested 100k deep is one `error` naming its line, where
    json.loads raised RecursionError."""
    return [loads_limited(line, f"{source} line {number}", max_bytes=max_bytes, max_depth=max_depth,
                          error=error, unique_keys=True, finite=True)
            for number, line in lines]
