"""What a tune run leaves in its run directory: result.json, recommended.toml (trials.csv: tuner.trials_frame).

Both are written atomically (temp file + rename), so an interrupted run leaves either the
previous complete file or the new one, never half of one. result.json's schema id is
"colibri.tune/1"; docs/TUNING.md documents its fields.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import EngineConfig, atomic_write_text, format_size

RESULT_SCHEMA = "colibri.tune/1"
BEST_CONFIG_SCHEMA = "colibri.best_config/1"

# Geometry keys that make two models interchangeable for a recorded best config.
GEOMETRY_KEYS = ("model_type", "layers", "hidden_size", "experts", "top_k", "moe_intermediate_size", "vocab_size")

def write_result_json(result: dict, path: str | Path) -> Path:
    atomic_write_text(path, json.dumps(result, indent=2, default=str) + "\n")
    return Path(path)


def write_recommended_toml(config: EngineConfig, result: dict, path: str | Path) -> Path:
    """The winner as an engine config (`colibri run --config`), with a header saying where from."""
    rec = result.get("recommended") or {}
    base = result.get("baseline") or {}
    fig = rec.get("confirmed") or {}
    bfig = base.get("confirmed") or {}
    cond = result.get("conditions", {})
    lines = [
        f"colibri tune recommendation ({result.get('created_utc', '')})",
        f"model: {result.get('model', {}).get('name', '')} ({result.get('model', {}).get('dir', '')})",
        f"budget: {format_size(result.get('budget_bytes'))}, objective: {result.get('objective')}, "
        f"{'cold' if cond.get('cold', True) else 'warm'} runs of {cond.get('tokens')} tokens x {cond.get('repeats')}",
        f"decode: {_fmt(fig.get('decode_tok_s'))} tok/s (baseline {_fmt(bfig.get('decode_tok_s'))}), "
        f"TTFT: {_fmt(fig.get('ttft_s'), 3)} s (baseline {_fmt(bfig.get('ttft_s'), 3)})",
        f"gain over baseline: {_pct(result.get('gain_over_baseline'))}; "
        f"source: trial {rec.get('trial_number')} of study {result.get('study', {}).get('name', '')!r}",
    ]
    config.save(path, header="\n".join(lines))
    return Path(path)


def best_config_entry(result: dict) -> dict:
    """The record a hardware profile keeps of this run (profile.best_configs), keyed by geometry."""
    rec = result.get("recommended") or {}
    return {
        "schema": BEST_CONFIG_SCHEMA,
        "model": result.get("model", {}).get("name"),
        "geometry": {k: result.get("model", {}).get("geometry", {}).get(k) for k in GEOMETRY_KEYS},
        "compute_dtype": result.get("model", {}).get("compute_dtype"),
        "ram_budget": result.get("budget_bytes"),
        "objective": result.get("objective"),
        "config": rec.get("config"),
        "figures": rec.get("confirmed"),
        "baseline_figures": (result.get("baseline") or {}).get("confirmed"),
        "gain_over_baseline": result.get("gain_over_baseline"),
        "conditions": result.get("conditions"),
        "created_utc": result.get("created_utc"),
    }


def same_geometry(a: dict | None, b: dict | None) -> bool:
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in GEOMETRY_KEYS)


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"
