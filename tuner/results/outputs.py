"""What a tune run leaves in its run directory: trials.csv, result.json, recommended.toml, the reports
and profile.json (the result itself is assembled by tuner/search/assemble.py).

All three are written atomically (temp file + rename), so an interrupted run leaves either the
previous complete file or the new one, never half of one. result.json follows
tuner/results/result.py's TuneResult (docs/schema/tune-result.schema.json; docs/TUNING.md explains it).
"""

from __future__ import annotations

from pathlib import Path

from engine.base.config import EngineConfig, atomic_write_text, format_size
from tuner.probe import load_profile, save_profile
from tuner.results.printers import fmt, json_text, pct, trials_csv
from tuner.results.report_html import write_html_report
from tuner.results.report_md import write_report
from tuner.results.result import BEST_CONFIG_SCHEMA, GEOMETRY_KEYS  # noqa: F401  (study reads outputs.GEOMETRY_KEYS)



def write_trials_csv(trials, path: str | Path) -> Path:
    atomic_write_text(path, trials_csv(trials))
    return Path(path)


def write_result_json(result: dict, path: str | Path) -> Path:
    atomic_write_text(path, json_text(result))
    return Path(path)


def write_recommended_toml(config: EngineConfig, result: dict, path: str | Path) -> Path:
    """The winner as an engine config (`colibri run --config`), with a header saying where from."""
    rec = result.get("recommended") or {}
    base = result.get("baseline") or {}
    fig = rec.get("confirmed") or {}
    bfig = base.get("confirmed") or {}
    dfig = (result.get("defaults") or {}).get("confirmed") or {}
    cond = result.get("conditions", {})
    lines = [
        f"colibri tune recommendation ({result.get('created_utc', '')})",
        f"model: {result.get('model', {}).get('name', '')} ({result.get('model', {}).get('dir', '')})",
        f"budget: {format_size(result.get('budget_bytes'))}, objective: {result.get('objective')}, "
        f"{'cold' if cond.get('cold', True) else 'warm'} runs of {cond.get('tokens')} tokens x {cond.get('repeats')}",
        f"decode: {fmt(fig.get('decode_tok_s'))} tok/s (defaults {fmt(dfig.get('decode_tok_s'))}, baseline "
        f"{fmt(bfig.get('decode_tok_s'))}), TTFT: {fmt(fig.get('ttft_s'), 3)} s (defaults {fmt(dfig.get('ttft_s'), 3)}, "
        f"baseline {fmt(bfig.get('ttft_s'), 3)})",
        f"gain over the engine's defaults: {pct(result.get('gain_over_defaults'), signed=True)} "
        f"(over the rules-of-thumb baseline: {pct(result.get('gain_over_baseline'), signed=True)}); "
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
        "quant": result.get("quant"),
        "ram_budget": result.get("budget_bytes"),
        "objective": result.get("objective"),
        "config": rec.get("config"),
        "figures": rec.get("confirmed"),
        "baseline_figures": (result.get("baseline") or {}).get("confirmed"),
        "gain_over_baseline": result.get("gain_over_baseline"),
        "defaults_figures": (result.get("defaults") or {}).get("confirmed"),
        "gain_over_defaults": result.get("gain_over_defaults"),
        "workload": result.get("workload"),
        "quality": result.get("quality"),
        "conditions": result.get("conditions"),
        "created_utc": result.get("created_utc"),
    }


def same_geometry(a: dict | None, b: dict | None) -> bool:
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in GEOMETRY_KEYS)


def warm_start_entry(profile_path: str, geometry: dict, log, quant: str | None = None) -> dict | None:
    """--from-profile: the fastest config the profile records for this model geometry (of
    those for this quant, when it records any)."""
    profile = load_profile(profile_path)
    matches = [e for e in profile.best_configs
               if isinstance(e, dict) and same_geometry(e.get("geometry"), geometry) and isinstance(e.get("config"), dict)]
    if not matches:
        log(f"--from-profile: {profile_path} records no config for this model geometry; "
            f"warm start from the baseline only")
        return None
    matches = [e for e in matches if e.get("quant") == quant] or matches
    return max(matches, key=lambda e: ((e.get("figures") or {}).get("decode_tok_s") or 0.0))


# --- writing a run's files ------------------------------------------------------------------

def write_outputs(run, result: dict) -> dict:
    """trials.csv, recommended.toml, result.json, report.md + plots, report.html, profile.json
    ({name: path})."""
    out = run.out
    files = {"trials.csv": write_trials_csv(run.study.get_trials(deepcopy=False), out / "trials.csv")}
    rec = result.get("recommended")
    if rec:
        config = EngineConfig.from_dict(rec["config"], source="recommended config")
        files["recommended.toml"] = write_recommended_toml(config, result, out / "recommended.toml")
    files["result.json"] = write_result_json(result, out / "result.json")
    try:
        files.update(write_report(run.study, result, out))
        files["report.html"] = write_html_report(out, study=run.study)
    except Exception as exc:  # the numbers are saved; a plotting problem must not lose them
        run.log(f"report: could not be written ({type(exc).__name__}: {exc})")
    if rec:
        files["profile.json"] = record_best_config(run.profile, result, out / "profile.json")
    return files


def record_best_config(profile, result: dict, path: Path) -> Path:
    """The run's profile.json, its best_configs holding this run's winner (replacing an older
    entry for the same geometry, quant, budget and objective)."""
    return record_best_configs(profile, [best_config_entry(result)], path)


def record_best_configs(profile, entries: list[dict], path: Path) -> Path:
    """`profile` saved to `path` with `entries` in its best_configs, each replacing an older
    entry of the same geometry, quant, budget and objective."""

    def same(e, entry) -> bool:
        return (isinstance(e, dict) and same_geometry(e.get("geometry"), entry["geometry"])
                and e.get("quant") == entry["quant"] and e.get("ram_budget") == entry["ram_budget"]
                and e.get("objective") == entry["objective"])

    keep = [e for e in profile.best_configs if not any(same(e, entry) for entry in entries)]
    profile.best_configs = keep + list(entries)
    return save_profile(profile, path)
