"""A `tune --quant` run directory read back: its record (quant-run.json), the probe its levels share
and the level directories that finished (each a tune run directory, tuner/results/rundir.py).

`tuner/search/quant_tune.py` writes these; export, compare and the report read them here, so they
depend on the documented files and not on the tuner that wrote them.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.api import ConfigError, GROUP_SIZES, QUANTS, loads_limited
from tuner.results.rundir import is_run_dir

RECORD_FILE = "quant-run.json"
PROBE_FILE = "probe.json"  # the probe every level shares; profile.json is it plus the levels' best configs
# A level's label: the source as stored (bf16/fp16/fp32), int8, or int4 with its group size (any
# number here: tune --quant names the group sizes the converter takes; a stored profile entry
# allows only those, QUANT_LABEL_RE).
UNQUANTIZED = ("bf16", "fp16", "fp32")
LEVEL_RE = re.compile(rf"^({'|'.join(UNQUANTIZED + QUANTS)})(?:-g(\d+))?(-all)?$")  # -all: scope "all"
QUANT_LABEL_RE = re.compile(rf"^({'|'.join(UNQUANTIZED + QUANTS)})(-g({'|'.join(map(str, GROUP_SIZES))}))?$")


def is_quant_run_dir(path) -> bool:
    return (Path(path) / RECORD_FILE).is_file()


def level_run_dirs(path) -> list[Path]:
    """A tune --quant run's level directories that finished (hold result.json), in level order."""
    return [Path(path) / l for l in recorded_levels(path) if is_run_dir(Path(path) / l)]


def recorded_levels(path) -> list[str]:
    record_path = Path(path) / RECORD_FILE
    record = loads_limited(record_path.read_bytes(), str(record_path), error=ConfigError)
    levels = record.get("levels") if isinstance(record, dict) else None
    if not isinstance(levels, list) or not all(isinstance(l, str) and LEVEL_RE.match(l) for l in levels):
        raise ConfigError(f"{record_path}: not a tune --quant record (no list of levels)")
    return levels
