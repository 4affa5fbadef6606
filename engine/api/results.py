"""The engine's typed results: RunResult (`colibri run`) and BenchResult (`colibri bench`), and the
field metadata every printer iterates (`figure`, `figures`), as llama-bench's printers iterate
`get_fields()`.

A result is a frozen dataclass with one schema id (`SCHEMA`). Its figure fields are read from the
engine's JSON (the "colibri.metrics/1" dict engine/run/run_metrics.py fills) by name; `data`
keeps that whole dict, so `to_dict()` is the JSON `--json` prints and a trial parses, unchanged.
A new figure is one field here: `from_dict` fills it from the JSON key of its name (or `key`),
and the printers (tuner/results/printers.py) show it with its label, unit and kind.

Field metadata (the keys tuner/results/columns.py reads from every figure field):
  label   the words before the value ("decode", "TTFT")
  short   a narrow header
  kind    how the value reads: float, seconds, ms, share, shares (a dict of shares), bytes, int, text
  unit    printed after the value ("tok/s", "s")
  line    which printed line the figure sits on (run_text: "speed", "io")
  key     the JSON key, when it is not the field's name ("hit_rate")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

# The JSON's own schema id (what stored results and trials read): unchanged.
METRICS_SCHEMA = "colibri.metrics/1"


def figure(label: str, short: str = "", kind: str = "float", unit: str = "", line: str = "speed",
           key: str = "", default=None):
    """A figure field: its printed label, kind, unit and line (module docstring)."""
    meta = {"label": label, "short": short or label, "kind": kind, "line": line}
    if unit:
        meta["unit"] = unit
    if key:
        meta["key"] = key
    return field(default=default, metadata=meta)


def figures(result_or_class) -> list[dataclasses.Field]:
    """The figure fields of a result (or its class), in declaration order."""
    return [f for f in dataclasses.fields(result_or_class) if "label" in f.metadata]


@dataclass(frozen=True)
class Result:
    """A typed engine result: figure fields over the whole JSON (`data`)."""

    SCHEMA: ClassVar[str] = ""
    data: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        """From the engine's JSON: each field from its key (absent: None), the dict kept whole."""
        if isinstance(d, cls):
            return d
        values = {f.name: d.get(f.metadata.get("key") or f.name) for f in dataclasses.fields(cls) if f.name != "data"}
        return cls(data=dict(d), **values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON, as the engine wrote it (what --json prints and trials parse)."""
        return dict(self.data)

    def get(self, key: str, default=None):
        """A key of the JSON that is no field (conditions: config, plan, geometry ...)."""
        return self.data.get(key, default)

    def __getitem__(self, key: str):
        return self.data[key]


@dataclass(frozen=True)
class RunResult(Result):
    """One generation (`colibri run`): latency, speed, memory, and I/O when it streamed."""

    SCHEMA: ClassVar[str] = "colibri.engine-run/1"

    ttft_s: Optional[float] = figure("TTFT", "TTFT", "seconds", "s")
    prefill_tok_s: Optional[float] = figure("prefill", "prefill", "float", "tok/s")
    decode_tok_s: Optional[float] = figure("decode", "decode", "float", "tok/s")
    token_latency_p50_ms: Optional[float] = figure("p50", "p50 ms", "ms", "ms")
    token_latency_p99_ms: Optional[float] = figure("p99", "p99 ms", "ms", "ms")
    peak_rss_bytes: Optional[int] = figure("peak RSS", "peak", "bytes")
    rss_file_bytes: Optional[int] = figure("file-backed", "file RSS", "bytes")
    bytes_read: Optional[int] = figure("read", "read", "bytes", line="io")
    read_gbps: Optional[float] = figure("at", "read", "float", "GB/s", line="io")
    hit_rate: Optional[dict] = figure("hit rate", "hit", "shares", line="io")
    lookahead_recall: Optional[float] = figure("lookahead recall", "recall", "share", line="io")
    io_stall_fraction: Optional[float] = figure("I/O stall", "stall", "share", line="io")
    # conditions the header prints (not figures)
    prompt_tokens: Optional[int] = None
    generated_tokens: Optional[int] = None
    compute_dtype: Optional[str] = None
    quant: Optional[str] = None
    kernel: Optional[str] = None
    threads: Optional[int] = None
    text: Optional[str] = None
    output_ids: Optional[list] = None

    @property
    def streamed(self) -> bool:
        """Whether the run read experts from disk (its I/O line means something)."""
        return self.bytes_read is not None


@dataclass(frozen=True)
class BenchResult(RunResult):
    """A bench (`colibri bench`): the run's figures as medians over the repeats, and the repeats'
    spread under `summary`."""

    SCHEMA: ClassVar[str] = "colibri.engine-bench/1"

    cold: Optional[bool] = None
    tokens: Optional[int] = None
    repeats: Optional[int] = None
    tokens_consistent: Optional[bool] = None
    summary: Optional[dict] = None
    io_mode_effective: Optional[str] = None
    io_backend_effective: Optional[str] = None

    def spread(self, name: str = "decode_tok_s") -> dict:
        """One headline figure's spread over the repeats: median, min, max, stdev, n."""
        return (self.summary or {}).get(name) or {"median": None, "min": None, "max": None, "stdev": None, "n": 0}
