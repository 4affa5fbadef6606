"""Routing histograms: how often each (layer, expert) was routed, recorded by a run and read by
the `pinned` policy to choose what to pin. JSON, schema "colibri.routing/1", written atomically.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Hashable, Mapping

from engine.base.config import atomic_write_text
from engine.base.errors import ConfigError
from engine.base.jsonlimits import loads_limited

ROUTING_SCHEMA = "colibri.routing/1"


def _routing_error(path, why: str) -> ConfigError:
    return ConfigError(f"routing histogram {path}: {why}")


def routing_histogram_save(hist: Mapping[tuple[int, int], int], path: str | os.PathLike) -> None:
    """Write {"schema": ..., "counts": {"L:E": n}} atomically (temp file + rename)."""
    path = os.fspath(path)
    counts = {}
    for (layer, expert), n in sorted(hist.items()):
        counts[f"{int(layer)}:{int(expert)}"] = int(n)
    payload = json.dumps({"schema": ROUTING_SCHEMA, "counts": counts}, indent=1)
    atomic_write_text(path, payload + "\n")


def routing_histogram_load(path: str | os.PathLike) -> Counter:
    """Counter {(layer, expert): count} from a file written by routing_histogram_save."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise _routing_error(path, "file not found") from None
    except OSError as exc:
        raise _routing_error(path, f"cannot read: {exc.strerror or exc}") from None
    data = loads_limited(raw, f"routing histogram {path}", error=ConfigError)
    if not isinstance(data, dict) or data.get("schema") != ROUTING_SCHEMA:
        raise _routing_error(path, f'expected "schema": "{ROUTING_SCHEMA}"')
    counts = data.get("counts")
    if not isinstance(counts, dict):
        raise _routing_error(path, '"counts" must be an object of "layer:expert": count')
    hist: Counter = Counter()
    for key, n in counts.items():
        parts = key.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise _routing_error(path, f'bad key {key!r} (expected "layer:expert")')
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise _routing_error(path, f"count for {key} must be a non-negative integer, got {n!r}")
        hist[(int(parts[0]), int(parts[1]))] = n
    return hist


def hottest_keys(hist: Mapping[Hashable, int], n: int | None = None) -> list[Hashable]:
    """Keys by descending count (ties by key, for a stable order); the first n if given."""
    ordered = sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))
    keys = [k for k, count in ordered if count > 0]
    return keys if n is None else keys[:n]
