"""What a tune run leaves in its run directory: trials.csv, result.json, recommended.toml.

All three are written atomically (temp file + rename), so an interrupted run leaves either the
previous complete file or the new one, never half of one. result.json follows
tuner/results/result.py's TuneResult (docs/schema/tune-result.schema.json; docs/TUNING.md explains it).
"""

from __future__ import annotations

from pathlib import Path

from engine.base.config import EngineConfig, atomic_write_text, format_size
from tuner.results.printers import fmt, json_text, pct, trials_csv, utc_now
from tuner.probe.errors import ProfileError
from tuner.results.result import (
    BEST_CONFIG_SCHEMA, RESULT_SCHEMA, Conditions, ConfirmationInfo, Figures, MemoryLimit, ModelInfo, ProfileSummary,
    QualityInfo, StudyInfo, TuneResult, Versions, OBJECTIVE_KEY,
)
from tuner.search.study_storage import redact_url

# Geometry keys that make two models interchangeable for a recorded best config.
GEOMETRY_KEYS = ("model_type", "layers", "hidden_size", "experts", "top_k", "moe_intermediate_size", "vocab_size")


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
    from tuner.probe import load_profile
    profile = load_profile(profile_path)
    matches = [e for e in profile.best_configs
               if isinstance(e, dict) and same_geometry(e.get("geometry"), geometry) and isinstance(e.get("config"), dict)]
    if not matches:
        log(f"--from-profile: {profile_path} records no config for this model geometry; "
            f"warm start from the baseline only")
        return None
    matches = [e for e in matches if e.get("quant") == quant] or matches
    return max(matches, key=lambda e: ((e.get("figures") or {}).get("decode_tok_s") or 0.0))


# --- assembling and writing a run's result --------------------------------------------------

COLD_MEANS = ("the model's pages are dropped from the page cache and the engine's caches emptied "
              "before every repeat: weights come from disk")


def build_result(run, decision) -> TuneResult:
    """The TuneResult of a finished session (`run` is study._Run, `decision` confirm.Decision)."""
    opts = run.opts
    winner, base, defaults = decision.winner, decision.baseline, decision.defaults
    key = OBJECTIVE_KEY[opts.objective]
    wfig = winner.confirmed if winner else None
    trials = run.study.get_trials(deepcopy=False)
    statuses: dict[str, int] = {}
    for t in trials:
        s = t.user_attrs.get("status", t.state.name.lower())
        statuses[s] = statuses.get(s, 0) + 1
    from tuner.search.confirm import feasible
    counts = run.search_counts  # tuner/search/explore.py: measured, re-proposals, distinct points
    wall = run.clock.used()
    return TuneResult(
        schema=RESULT_SCHEMA, created_utc=utc_now(), started_utc=run.started_utc,
        model=ModelInfo(name=run.model_name, dir=str(run.model_dir), geometry=run.facts.geometry,
                        compute_dtype=run.space.compute_dtype_name()),
        budget_bytes=run.budget, budget=format_size(run.budget), objective=opts.objective,
        recommended=winner.candidate() if winner else None, baseline=base.candidate(),
        gain_over_baseline=gain(wfig, base.confirmed, key), gain_metric=key,
        candidates=[e.candidate() for e in decision.contenders],
        confirmation=ConfirmationInfo(rounds=decision.rounds, confirmed=decision.confirmed),
        study=StudyInfo(
            name=run.study_name, storage=redact_url(run.storage_url), trials=len(trials),
            feasible=len(feasible([t for t in trials if t.user_attrs.get("duplicate_of") is None])), by_status=statuses, sampler=type(run.study.sampler).__name__,
            sampler_note="chosen by benchmarks/tuner_quality.py (GP for one objective, TPE for two)"
            if opts.sampler == "auto" else "set by --sampler", directions=[d.name for d in run.study.directions],
            measured_trials=counts.measured, re_proposals=counts.re_proposals,
            distinct_points=counts.distinct_points, explored=counts.explored, stop_reason=run.stop_reason or None,
            measuring_seconds=round(run.measuring_seconds, 1),
            measuring_share=round(run.measuring_seconds / wall, 4) if wall > 0 else None),
        conditions=Conditions(
            cold=opts.cold, cold_means=COLD_MEANS if opts.cold else "warm: caches persist across repeats",
            tokens=opts.tokens, repeats=opts.repeats, prompt_tokens=opts.prompt_tokens, seed=opts.seed,
            min_ctx=opts.min_ctx,
            memory_limit=MemoryLimit(cgroup_limit_bytes=run.limit_bytes, cgroup=run.calibration.get("cgroup_limited"),
                                     reason=run.calibration.get("cgroup_reason") or ""),
            precheck_overhead_bytes=run.space.overhead_bytes, time_budget_s=run.clock.seconds,
            wall_seconds=round(run.clock.used(), 1), physical_cores=run.space.physical_cores,
            logical_cores=run.space.logical_cores, gpu=run.has_gpu,
            profile=profile_summary(run.profile, run.profile_source), search_space=run.space.describe(),
            versions=versions()),
        quant=run.facts.quant,
        quality=decode_quality(opts.quality),
        defaults=defaults.candidate() if defaults else None,
        gain_over_defaults=gain(wfig, defaults.confirmed if defaults else None, key),
        workload=run.workload_info)


def gain(winner: Figures | None, reference: Figures | None, key: str) -> float | None:
    """The winner's gain over a reference on the objective's figure (> 0: better; for seconds,
    how much faster: reference / winner - 1)."""
    w, b = getattr(winner, key, None), getattr(reference, key, None)
    if not w or not b:
        return None
    return (b / w - 1.0) if key in ("ttft_s", "request_s") else (w / b - 1.0)


def decode_quality(quality: dict | None) -> QualityInfo | None:
    if quality is None:
        return None
    return decode(QualityInfo, quality, "quality", ResultError)


def profile_summary(p, source: str) -> ProfileSummary:
    out = ProfileSummary(source=source, fingerprint=p.fingerprint, probe_mode=p.probe.mode,
                         storage_method=p.storage.method, disk_transport=p.system.disk.transport,
                         disk_model=p.system.disk.model, filesystem=p.system.disk.filesystem)
    try:
        out.read_gbps_1MiB_qd4_direct = round(p.read_bandwidth(1 << 20, 4) / 1e9, 3)
    except ProfileError:  # a profile without a direct curve: the figure is simply unknown
        pass
    seq = p.storage_point("sequential")
    if seq is not None:
        out.sequential_gbps = round(seq.bandwidth.value / 1e9, 3)
    return out


def versions() -> Versions:
    import platform

    import optuna

    from engine import __version__ as engine_version
    from engine.run.metrics import git_commit
    return Versions(engine=engine_version, git_commit=git_commit(), optuna=optuna.__version__,
                    python=platform.python_version())


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
        from tuner.results.report_md import write_report
        files.update(write_report(run.study, result, out))
        from tuner.results.report_html import write_html_report
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
    from tuner.probe import save_profile

    def same(e, entry) -> bool:
        return (isinstance(e, dict) and same_geometry(e.get("geometry"), entry["geometry"])
                and e.get("quant") == entry["quant"] and e.get("ram_budget") == entry["ram_budget"]
                and e.get("objective") == entry["objective"])

    keep = [e for e in profile.best_configs if not any(same(e, entry) for entry in entries)]
    profile.best_configs = keep + list(entries)
    return save_profile(profile, path)
