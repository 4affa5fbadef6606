"""Judging a measured trial and turning it into the study's objective values: pure functions.

Infeasible configs are COMPLETE trials with a poor but realistic objective (0 tok/s, or a TTFT
of the trial timeout) and a positive, graded constraint, never FAIL: a FAIL teaches the sampler
nothing. The size of a violation grades how bad it was, so the sampler can tell 'nearly fits'
from 'hopeless'.
"""

from __future__ import annotations

from engine.api import format_size
from tuner.results.result import (  # noqa: F401
    OBJECTIVE_KEY, OBJECTIVES, RunFigures, TrialRecord, TrialResult, point_key)

DIRECTIONS = {"decode": ["maximize"], "ttft": ["minimize"], "request": ["minimize"], "both": ["maximize", "minimize"],
              "serve": ["maximize"]}
# The figure each objective ranks by is OBJECTIVE_KEY (tuner/results/result.py, where the
# result's gain_metric is named).
LOWER_IS_BETTER = ("ttft", "request")


def ranks_lower(objective: str) -> bool:
    """Whether a smaller figure of the objective's key is better (seconds, not tok/s)."""
    return objective in LOWER_IS_BETTER
# How the study searches for it: auto is GP for one objective, TPE for two (tune_options.make_sampler).
SAMPLERS = ("auto", "gp", "tpe", "random")


def judge(res: TrialResult, budget: int, limit_bytes: int, reference_ids: list | None) -> tuple[str, float, str]:
    """(status, constraint, error) of one run: constraint <= 0 is feasible.

    reference_ids: the output tokens of the first ok trial with the same thread count (placement
    must never change tokens), or None when there is none yet.
    """
    # The kind comes from the trial's outcome record and the cgroup (tuner/search/outcome.py), never
    # from its stderr text. The constraint grades how far off a config was.
    if res.status == "oom_killed":
        peak = res.cgroup_peak_bytes or res.cgroup_limit_bytes or limit_bytes
        return "oom_killed", round(0.05 + max(0, peak - budget) / budget, 6), res.error
    if res.status in ("timeout", "over_budget"):  # near misses: a little slower or bigger would fit
        return res.status, 0.05, res.error
    if res.status != "ok":  # crashed, killed, bad_config: nothing learnt about speed or size
        return res.status, 0.5, res.error
    m = res.metrics
    if not m.get("tokens_consistent", True):
        return "tokens_inconsistent", 1.0, "output tokens differ between repeats of one config"
    if reference_ids is not None and m.get("output_ids") != reference_ids:
        return "tokens_changed", 1.0, (f"output tokens differ from the first trial with {m.get('threads')} "
                                       f"threads (placement must never change tokens)")
    peak = m.get("peak_rss_bytes") or 0
    if not res.cgroup_limited and peak > budget:
        # Without a cgroup nothing else enforces the budget: the process's own peak must fit.
        return "over_budget", round((peak - budget) / budget, 6), \
            f"peak RSS {format_size(peak)} over the budget {format_size(budget)}"
    return "ok", 0.0, ""


def worst_values(objective: str, timeout: float) -> list[float]:
    """An infeasible trial's objective: nothing decoded (no request served), TTFT (or a request) as
    long as the trial may take."""
    return {"decode": [0.0], "ttft": [float(timeout)], "request": [float(timeout)],
            "both": [0.0, float(timeout)], "serve": [0.0]}[objective]


def objective_values(objective: str, metrics: dict, timeout: float) -> list[float]:
    decode = float(metrics.get("decode_tok_s") or 0.0)
    ttft = metrics.get("ttft_s")
    ttft = float(ttft) if ttft is not None else float(timeout)
    request = metrics.get("request_s")
    request = float(request) if request is not None else float(timeout)
    # serve: goodput of the trace replay (engine/run/trace_replay.py); ties, as 0 when no request met
    # the SLOs, are broken by p95 TTFT in the ranking (confirm.ranked), not in the sampler's value.
    goodput = float(metrics.get("goodput_rps") or 0.0)
    return {"decode": [decode], "ttft": [ttft], "request": [request], "both": [decode, ttft],
            "serve": [goodput]}[objective]


def record(res: TrialResult, *, role: str, worker: str, config: dict, status: str, constraint: float,
           error: str) -> TrialRecord:
    """The study's record of a launched trial: verdict, cgroup facts and every bench figure."""
    return TrialRecord(
        role=role, worker=worker, config=config, status=status, constraint=constraint,
        wall_seconds=round(res.wall_seconds, 3), error=error or res.error or None, trial_status=res.status,
        cgroup_limited=res.cgroup_limited, cgroup_limit_bytes=res.cgroup_limit_bytes,
        cgroup_peak_bytes=res.cgroup_peak_bytes, cgroup_reason=res.cgroup_reason,
        figures=RunFigures.from_metrics(res.metrics) if res.ok else RunFigures(),
        output_ids=res.metrics.get("output_ids") if res.ok else None, metrics=res.metrics if res.ok else None)


def not_launched(*, role: str, worker: str, config: dict, overshoot: int, budget: int, message: str) -> TrialRecord:
    """A config the memory pre-check refused: recorded infeasible without a subprocess."""
    return TrialRecord(role=role, worker=worker, config=config, status="over_budget_plan",
                       constraint=round(overshoot / budget, 6), error=message, wall_seconds=0.0)


def reference_ids(trials, threads, lossy: dict | None = None) -> list | None:
    """Output tokens of the first ok trial run with `threads` compute threads (and, in a lossy
    search, the same lossy settings: those change tokens by design; placement still must not)."""
    for t in sorted(trials, key=lambda t: t.number):
        a = t.user_attrs
        same_lossy = lossy is None or all((a.get("config") or {}).get(k) == v for k, v in lossy.items())
        if a.get("status") == "ok" and a.get("threads") == threads and a.get("output_ids") is not None \
                and same_lossy:
            return a["output_ids"]
    return None


def same_point(trials, params: dict):
    """An earlier complete trial at these params (stepped floats compared rounded), or None."""
    key = point_key(params)
    for t in trials:
        if "constraint" in t.user_attrs and t.values is not None and point_key(t.params) == key:
            return t
    return None

