"""What a tune run leaves in its run directory: trials.csv, result.json, recommended.toml, the reports
and profile.json (the result itself is assembled by tuner/search/assemble.py).

All three are written atomically (temp file + rename), so an interrupted run leaves either the
previous complete file or the new one, never half of one. result.json follows
tuner/results/result.py's TuneResult (docs/schema/tune-result.schema.json; docs/TUNING.md explains it).
"""

from __future__ import annotations

from pathlib import Path

from engine.api import EngineConfig, atomic_write_text, format_size
from tuner.probe import load_profile, save_profile
from tuner.results.frames import trials_csv
from tuner.results.printers import NOT_MEASURED, fmt, json_text, pct
from tuner.results.report_html import write_html_report
from tuner.results.report_md import write_report
from tuner.results.reproduce import reproduce_command
from tuner.results.result import (  # noqa: F401  (study reads outputs.GEOMETRY_KEYS)
    BEST_CONFIG_SCHEMA, GEOMETRY_KEYS, Candidate, Figures, TuneResult, plain)


def write_trials_csv(trials, path: str | Path) -> Path:
    atomic_write_text(path, trials_csv(trials))
    return Path(path)


def write_result_json(result: TuneResult, path: str | Path) -> Path:
    atomic_write_text(path, json_text(result.to_dict()))
    return Path(path)


def write_recommended_toml(config: EngineConfig, r: TuneResult, path: str | Path) -> Path:
    """The winner as an engine config (`colibri run --config`), with a header saying where from."""
    fig, dfig, bfig = (_confirmed(c) for c in (r.recommended, r.defaults, r.baseline))
    cond = r.conditions
    lines = [
        f"colibri tune recommendation ({r.created_utc})",
        f"model: {r.model.name} ({r.model.dir})",
        f"budget: {format_size(r.budget_bytes)}, objective: {r.objective}, "
        f"{'cold' if cond.cold else 'warm'} runs of {cond.tokens} tokens x {cond.repeats}",
        f"decode: {fmt(fig.decode_tok_s)} tok/s (defaults {fmt(dfig.decode_tok_s)}, baseline "
        f"{fmt(bfig.decode_tok_s)}), TTFT: {fmt(fig.ttft_s, 3)} s (defaults {fmt(dfig.ttft_s, 3)}, "
        f"baseline {fmt(bfig.ttft_s, 3)})",
        *([f"goodput: {fmt(fig.goodput_rps, 3)} req/s within TTFT <= {fmt(r.workload.slo_ttft_s, 3)} s and TPOT <= "
           f"{fmt(r.workload.slo_tpot_s, 3)} s (defaults {fmt(dfig.goodput_rps, 3)}, baseline {fmt(bfig.goodput_rps, 3)})"]
          if r.objective == "serve" and r.workload is not None else []),
        f"gain over the engine's defaults: {pct(r.gain_over_defaults, signed=True)} "
        f"(over the rules-of-thumb baseline: {pct(r.gain_over_baseline, signed=True)}); "
        f"source: trial {r.recommended.trial_number if r.recommended else None} of study {r.study.name!r}",
    ]
    if r.reproduce is not None and r.reproduce.command:
        lines += [f"measure the {'goodput' if r.objective == 'serve' else 'decode'} figure again (same workload, "
                  "tokens, cgroup):", f"  {r.reproduce.command}"]
    config.save(path, header="\n".join(lines))
    return Path(path)


def _confirmed(c: Candidate | None) -> Figures:
    return c.confirmed if c and c.confirmed else NOT_MEASURED


def best_config_entry(r: TuneResult) -> dict:
    """The record a hardware profile keeps of this run (profile.best_configs), keyed by geometry."""
    rec = r.recommended
    return {
        "schema": BEST_CONFIG_SCHEMA,
        "model": r.model.name,
        "geometry": {k: r.model.geometry.get(k) for k in GEOMETRY_KEYS},
        "compute_dtype": r.model.compute_dtype,
        "quant": r.quant,
        "ram_budget": r.budget_bytes,
        "objective": r.objective,
        "config": dict(rec.config) if rec else None,
        "figures": plain(rec.confirmed) if rec else None,
        "baseline_figures": plain(r.baseline.confirmed) if r.baseline else None,
        "gain_over_baseline": r.gain_over_baseline,
        "defaults_figures": plain(r.defaults.confirmed) if r.defaults else None,
        "gain_over_defaults": r.gain_over_defaults,
        "workload": plain(r.workload),
        "quality": plain(r.quality),
        "conditions": plain(r.conditions),
        "created_utc": r.created_utc,
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

def write_outputs(out: Path, study, profile, result: TuneResult, log) -> dict:
    """trials.csv, recommended.toml, result.json, report.md + plots, report.html, profile.json
    ({name: path}) in `out`, from the finished `study` (an optuna.Study) and `result`."""
    files = {"trials.csv": write_trials_csv(study.get_trials(deepcopy=False), out / "trials.csv")}
    rec = result.recommended
    if rec:
        config = EngineConfig.from_dict(rec.config, source="recommended config")
        if result.reproduce is not None:  # the command names the file it is written beside
            result.reproduce.command = reproduce_command(result, (out / "recommended.toml").resolve())
        files["recommended.toml"] = write_recommended_toml(config, result, out / "recommended.toml")
    files["result.json"] = write_result_json(result, out / "result.json")
    try:
        files.update(write_report(study, result, out))
        files["report.html"] = write_html_report(out, study=study)
    except Exception as exc:  # the numbers are saved; a plotting problem must not lose them
        log(f"report: could not be written ({type(exc).__name__}: {exc})")
    if rec:
        files["profile.json"] = record_best_config(profile, result, out / "profile.json")
    return files


def record_best_config(profile, result: TuneResult, path: Path) -> Path:
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
