"""What a tune run leaves in its run directory: trials.csv, result.json, recommended.toml.

All three are written atomically (temp file + rename), so an interrupted run leaves either the
previous complete file or the new one, never half of one. result.json's schema id is
"colibri.tune/1"; docs/TUNING.md documents its fields.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from engine.config import EngineConfig, atomic_write_text, format_size

RESULT_SCHEMA = "colibri.tune/1"
BEST_CONFIG_SCHEMA = "colibri.best_config/1"

# Geometry keys that make two models interchangeable for a recorded best config.
GEOMETRY_KEYS = ("model_type", "layers", "hidden_size", "experts", "top_k", "moe_intermediate_size", "vocab_size")

# Trial figures copied into their own CSV columns (the full bench JSON stays in the study).
METRIC_COLUMNS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "token_latency_p50_ms", "token_latency_p99_ms",
                  "read_gbps", "io_stall_fraction", "lookahead_recall", "bytes_read_per_token", "hit_rate_ram",
                  "peak_rss_bytes", "cgroup_peak_bytes", "plan_cache_bytes")
PARAM_COLUMNS = ("chunk_size", "prefetch_depth", "cpu_cache_ratio", "gpu_cache_ratio", "threads", "ctx_size",
                 "io_mode", "io_threads", "cache_policy")


def trial_rows(trials) -> list[dict]:
    """One flat row per Optuna trial (FrozenTrial), in trial-number order."""
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        a = t.user_attrs
        row = {"number": t.number, "state": t.state.name, "status": a.get("status", ""), "role": a.get("role", ""),
               "feasible": a.get("constraint", 1.0) <= 0 if "constraint" in a else "",
               "constraint": a.get("constraint", "")}
        values = t.values or []
        row["value"] = values[0] if len(values) > 0 else ""
        row["value2"] = values[1] if len(values) > 1 else ""
        for p in PARAM_COLUMNS:
            v = t.params.get(p, "")
            row[p] = round(v, 6) if isinstance(v, float) else v  # 0.8500000000000001 is a step artefact
        for m in METRIC_COLUMNS:
            v = a.get(m)
            row[m] = "" if v is None else v
        row["wall_seconds"] = round(a["wall_seconds"], 3) if isinstance(a.get("wall_seconds"), (int, float)) else ""
        row["duplicate_of"] = a.get("duplicate_of", "")
        row["worker"] = a.get("worker", "")
        row["error"] = a.get("error", "")
        rows.append(row)
    return rows


def write_trials_csv(trials, path: str | Path) -> Path:
    rows = trial_rows(trials)
    columns = ["number", "state", "status", "role", "feasible", "constraint", "value", "value2", *PARAM_COLUMNS,
               *METRIC_COLUMNS, "wall_seconds", "duplicate_of", "worker", "error"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())
    return Path(path)


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
