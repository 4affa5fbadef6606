"""The one column registry: every engine setting and figure a table shows, derived from the dataclasses.

A column's name, label, short name, unit and number format come from its field's metadata:
EngineConfig's knobs (engine/base/config.py `knob`), RunFigures' figures and QualityInfo's
quality figures (tuner/results/result.py `figure`). trials.csv, report.md's trial table and
report.html's table read these columns, so a new knob or figure is one field, shown everywhere
with the same name and format.

  CONFIG_COLUMNS   one per EngineConfig field (what a trial ran: its config, lossy settings included)
  FIGURE_COLUMNS   one per figure of RunFigures and TrialRecord (the cgroup's peak)
  QUALITY_COLUMNS  a lossy trial's quality against the lossless reference (tune --max-kl/--min-top1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.api import EngineConfig, format_size, size_label
from tuner.base.text import fmt, kl_text, pct
from tuner.results.result import QualityInfo
from tuner.results.trial_record import RunFigures, TrialRecord


@dataclass(frozen=True)
class Column:
    """One column: `name` is the key (trials.csv header, result.json / config key)."""

    name: str
    label: str  # a header where there is room (report.md, report.html)
    short: str  # a narrow header (text tables)
    kind: str  # how a value reads: size, bytes, int, float, share, seconds, kl, choice, path, bool
    unit: str = ""
    lossy: bool = False  # an engine setting that changes the output tokens
    searched: bool = False  # an engine setting `colibri tune` searches (its knob's search= range)

    def text(self, value: Any) -> str:
        """The value as every table prints it ('-' when unknown)."""
        if value is None or value == "":
            return "-"
        if self.kind == "size":
            return size_label(int(value)) if value else "0"
        if self.kind == "bytes":
            return format_size(value)
        if self.kind == "share":
            return pct(value, 0)
        if self.kind == "seconds":
            return fmt(value, 3)
        if self.kind == "float":
            return fmt(value) if isinstance(value, (int, float)) else str(value)
        if self.kind == "kl":
            return kl_text(value)
        return str(value)

    def parse(self, cell: str) -> Any:
        """A trials.csv cell back as the field's type (None when empty)."""
        if cell is None or cell == "":
            return None
        if self.kind in ("size", "bytes", "int"):
            return int(float(cell))
        if self.kind in ("float", "share", "seconds", "kl"):
            return float(cell)
        if self.kind == "bool":
            return cell == "True"
        return cell


def _columns(cls) -> tuple[Column, ...]:
    return tuple(Column(f.name, f.metadata["label"], f.metadata["short"], f.metadata["kind"],
                        f.metadata.get("unit", ""), bool(f.metadata.get("lossy")), bool(f.metadata.get("search")))
                 for f in dataclasses.fields(cls) if "label" in f.metadata)


CONFIG_COLUMNS = _columns(EngineConfig)
FIGURE_COLUMNS = _columns(RunFigures) + _columns(TrialRecord)  # the trial's figures, then its cgroup's peak
QUALITY_COLUMNS = _columns(QualityInfo)
BY_NAME = {c.name: c for c in CONFIG_COLUMNS + FIGURE_COLUMNS + QUALITY_COLUMNS}


def column(name: str) -> Column:
    return BY_NAME[name]


def config_from_row(row: dict, **overrides) -> EngineConfig:
    """The engine config a trials.csv row ran: every config column the file has (an older file
    lacks the lossy ones: their defaults apply), then `overrides`."""
    values = {c.name: c.parse(row.get(c.name)) for c in CONFIG_COLUMNS}
    return EngineConfig().replace(**values).replace(**overrides)
