"""A finished tune session as its TuneResult: the recommendation, the references, the study's
counts, the conditions and the versions (result.json, tuner/results/result.py).

It reads a `FinishedSession` (the session, setup.py's TuneSession, with what its study ran: the
study and its counts; study.py makes one when the search and confirmation are over) and the
confirmation round's decision (confirm.Decision); tuner/results/outputs.py writes the files from
the result.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import optuna

from engine.api import __version__ as engine_version, format_size, git_commit
from tuner.base.text import utc_now
from tuner.base.typed_json import decode
from tuner.probe.probe_errors import ProfileError
from tuner.results.result import (
    OBJECTIVE_KEY, RESULT_SCHEMA, Candidate, Conditions, ConfirmationInfo, Figures, MemoryLimit, ModelInfo, ProfileSummary,
    QualityInfo, Reproduce, ResultError, RunFigures, SettingQuality, StudyInfo, TuneResult, Versions, WorkloadInfo,
)
from tuner.results import reproduce
from tuner.search.prediction import cost_model_run
from tuner.search.confirm import Decision, feasible
from tuner.search.explore import SearchCounts
from tuner.search.setup import TuneSession
from tuner.search.study_storage import redact_url

COLD_MEANS = ("the model's pages are dropped from the page cache and the engine's caches emptied "
              "before every repeat: weights come from disk")


@dataclass(frozen=True)
class FinishedSession:
    """A tune session once its search and confirmation are over: the session itself (setup.py's
    TuneSession, typed) and what its search ran. The result is built from this alone."""

    session: TuneSession
    study: optuna.Study
    search_counts: SearchCounts
    stop_reason: str
    measuring_seconds: float
    cost_model_state: dict | None = None  # tuner/search/prediction.py: calibrated or not, the warm starts


def build_result(run: FinishedSession, decision: Decision) -> TuneResult:
    """The TuneResult of a finished session."""
    s = run.session
    opts = s.opts
    winner, base, defaults = decision.winner, decision.baseline, decision.defaults
    key = OBJECTIVE_KEY[opts.objective]
    wfig = winner.confirmed if winner else None
    trials = run.study.get_trials(deepcopy=False)
    statuses: dict[str, int] = {}
    for t in trials:
        status = t.user_attrs.get("status", t.state.name.lower())
        statuses[status] = statuses.get(status, 0) + 1
    quality = setting_quality(trials)
    counts = run.search_counts  # tuner/search/explore.py: measured, re-proposals, distinct points
    wall = s.clock.used()
    return TuneResult(
        schema=RESULT_SCHEMA, created_utc=utc_now(), started_utc=s.started_utc,
        model=ModelInfo(name=s.model_name, dir=str(s.model_dir), geometry=s.facts.geometry,
                        compute_dtype=s.space.compute_dtype_name()),
        budget_bytes=s.budget, budget=format_size(s.budget), objective=opts.objective,
        recommended=with_quality(winner.candidate(), quality) if winner else None,
        baseline=with_quality(base.candidate(), quality),
        gain_over_baseline=gain(wfig, base.confirmed, key), gain_metric=key,
        candidates=[with_quality(e.candidate(), quality) for e in decision.contenders],
        confirmation=ConfirmationInfo(rounds=decision.rounds, confirmed=decision.confirmed),
        study=StudyInfo(
            name=s.study_name, storage=redact_url(s.storage_url), trials=len(trials),
            feasible=len(feasible([t for t in trials if t.user_attrs.get("duplicate_of") is None])), by_status=statuses, sampler=type(run.study.sampler).__name__,
            sampler_note="chosen by benchmarks/tuning/tuner_quality.py (GP for one objective, TPE for two)"
            if opts.sampler == "auto" else "set by --sampler", directions=[d.name for d in run.study.directions],
            measured_trials=counts.measured, re_proposals=counts.re_proposals,
            distinct_points=counts.distinct_points, explored=counts.explored, stop_reason=run.stop_reason or None,
            measuring_seconds=round(run.measuring_seconds, 1),
            measuring_share=round(run.measuring_seconds / wall, 4) if wall > 0 else None),
        conditions=Conditions(
            cold=opts.cold, cold_means=COLD_MEANS if opts.cold else "warm: caches persist across repeats",
            tokens=opts.tokens, repeats=opts.repeats, prompt_tokens=opts.prompt_tokens, seed=opts.seed,
            min_ctx=opts.min_ctx,
            memory_limit=MemoryLimit(cgroup_limit_bytes=s.limit_bytes, cgroup=s.calibration.get("cgroup_limited"),
                                     reason=s.calibration.get("cgroup_reason") or ""),
            precheck_overhead_bytes=s.space.overhead_bytes, time_budget_s=s.clock.seconds,
            wall_seconds=round(s.clock.used(), 1), physical_cores=s.space.physical_cores,
            logical_cores=s.space.logical_cores, gpu=s.has_gpu,
            profile=profile_summary(s.profile, s.profile_source), search_space=s.space.describe(),
            versions=versions()),
        quant=s.facts.quant,
        quality=decode_quality(opts.quality),
        defaults=with_quality(defaults.candidate(), quality) if defaults else None,
        gain_over_defaults=gain(wfig, defaults.confirmed if defaults else None, key),
        workload=s.workload_info,
        reproduce=reproduce_record(winner, run.study, s.workload_info),
        cost_model=cost_model_run(trials, run.cost_model_state))


def reproduce_record(winner, study, workload: WorkloadInfo | None) -> Reproduce | None:
    """What the headline figure measured (the command itself is written with recommended.toml,
    whose path it names: outputs.py). Confirmed: the confirmation runs; else the search trial."""
    if winner is None:
        return None
    runs, ids = winner.runs, (winner.output_ids[0] if winner.output_ids else None)
    attrs = {}
    if not runs and winner.trial_number is not None:
        attrs = study.trials[winner.trial_number].user_attrs
        runs, ids = [RunFigures.from_metrics(attrs.get("metrics") or {})], attrs.get("output_ids")
    m = reproduce.measured(runs, ids)
    metrics = attrs.get("metrics") or {}
    degenerate = ((metrics.get("workload") or {}).get("degenerate") if metrics else
                  max((r.degenerate_prompts or 0 for r in winner.runs), default=None))
    return Reproduce(command="", workload_sha256=workload.sha256 if workload else None,
                     degenerate_prompts=degenerate, **m)


def setting_quality(trials) -> dict[int, SettingQuality]:
    """Each measured lossy trial's quality (tune --max-kl / --min-top1 put it in its user_attrs)."""
    out = {}
    for t in trials:
        q = t.user_attrs.get("quality")
        if isinstance(q, dict) and all(isinstance(q.get(k), (int, float)) for k in ("kl_mean", "kl_p99",
                                                                                  "top1_agreement")):
            out[t.number] = SettingQuality(kl_mean=q["kl_mean"], kl_p99=q["kl_p99"], top1_agreement=q["top1_agreement"])
    return out


def with_quality(candidate: Candidate, quality: dict[int, SettingQuality]) -> Candidate:
    """The candidate with its search trial's lossy-setting quality, when it has one."""
    candidate.quality = quality.get(candidate.trial_number)
    return candidate


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
    return Versions(engine=engine_version, git_commit=git_commit(), optuna=optuna.__version__,
                    python=platform.python_version())
