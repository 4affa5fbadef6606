"""run.json: what a run directory's tune was started with, so that `--resume` continues it.

The default budget (88% of available memory) and the default study name that carries it change
with the machine's free memory between two runs; a resume that re-derived them looked for a
study that was never made ("nothing to resume: no study 'tiny-20789MiB-decode' ... (studies
there: tiny-20785MiB-decode)"). The first run records its budget and study here; a resume reuses
them unless told otherwise, and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.api import ConfigError, atomic_write_text, loads_limited

RUN_FILE = "run.json"
SCHEMA = "colibri.run/1"


def read_run_record(out: Path) -> dict | None:
    """The record of the run in `out`, or None when there is none (a run made before run.json)."""
    path = Path(out) / RUN_FILE
    if not path.is_file():
        return None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    record = loads_limited(raw, str(path), error=ConfigError)
    budget = record.get("budget") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or record.get("schema") != SCHEMA or isinstance(budget, bool)
            or not isinstance(budget, int) or budget <= 0 or not isinstance(record.get("study_name"), str)):
        raise ConfigError(f"{path}: not a run record (needs schema {SCHEMA!r}, a positive integer budget "
                          "and a study_name); pass --ram-budget and --study-name to resume without it")
    return record


def write_run_record(out: Path, *, model: str, model_dir: Path, budget: int, study_name: str, objective: str,
                     storage: str) -> None:
    atomic_write_text(Path(out) / RUN_FILE, json.dumps({
        "schema": SCHEMA, "model": model, "model_dir": str(model_dir), "budget": budget,
        "study_name": study_name, "objective": objective, "storage": storage}, indent=2) + "\n")
