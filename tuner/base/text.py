"""The text formatters every printer uses: numbers, shares, sizes in tables, timestamps, JSON.

A figure reads the same wherever it is shown because it is formatted here once; the printers
(tuner/results/printers.py) and the probe's summary both use these.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any, Iterable, Sequence


def fmt(v, digits: int = 2) -> str:
    """A number with `digits` decimals, or '-' when unknown."""
    return "-" if v is None else f"{v:.{digits}f}"


def pct(v, digits: int = 1, signed: bool = False) -> str:
    """0.123 -> '12.3%' ('+12.3%' signed), or '-' when unknown."""
    return "-" if v is None else f"{v:{'+' if signed else ''}.{digits}%}"


def utc_now() -> str:
    """Now as an ISO 8601 UTC timestamp to the second: 2026-12-01T07:00:00Z."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def json_text(obj) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


def print_json(obj, stream=None) -> None:
    (stream or sys.stdout).write(json_text(obj))


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 0) -> list[str]:
    """Aligned columns: the first `left` columns (labels) flush left, the numbers right."""
    rows = [list(r) for r in rows]
    widths = [max(len(r[i]) for r in [list(header)] + rows) for i in range(len(header))]

    def line(row) -> str:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  " + "  ".join(cells).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def kl_text(v) -> str:
    """A KL divergence: they span decades (int8 ~1e-6, int4 ~1e-2 on real models), so small ones
    in scientific notation rather than rounded to 0."""
    if v is None:
        return "-"
    return "0" if v == 0 else f"{v:.2e}" if abs(v) < 1e-3 else f"{v:.4f}"
