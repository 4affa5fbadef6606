"""The published JSON Schemas (docs/schema/*.json): the tune result and the hardware profile.

`python -m tuner.results.schema` regenerates them from the dataclasses (tuner/base/typed_json.py
does the work); tests/test_tuner_parts.py fails when they are stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.api import atomic_write_text
from tuner.base.typed_json import json_schema
from tuner.probe.hardware_profile import SCHEMA_VERSION, HardwareProfile
from tuner.results.result import RESULT_SCHEMA, TuneResult


def schema_documents() -> dict[str, dict]:
    """Every published schema, by file name under docs/schema/."""
    return {
        "tune-result.schema.json": json_schema(
            TuneResult, f"colibri:{RESULT_SCHEMA}", "colibri tune result (result.json)",
            "What `colibri tune` writes to <run>/result.json and prints with --json."),
        "hardware-profile.schema.json": json_schema(
            HardwareProfile, f"colibri:colibri.profile/{SCHEMA_VERSION}", "colibri hardware profile",
            "What `colibri probe -o` writes (docs/PROFILE.md explains the fields)."),
    }


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2) + "\n"


def write_schemas(out_dir: str | Path) -> list[Path]:
    """Regenerate docs/schema/*.json (python -m tuner.results.schema)."""
    out_dir = Path(out_dir)
    paths = []
    for name, doc in schema_documents().items():
        atomic_write_text(out_dir / name, render(doc))
        paths.append(out_dir / name)
    return paths


if __name__ == "__main__":
    for p in write_schemas(Path(__file__).resolve().parents[2] / "docs" / "schema"):
        print(p)
