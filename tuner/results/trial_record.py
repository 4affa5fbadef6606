"""One run's figures and one trial: RunFigures, TrialResult, TrialRecord, and how a trial ended.

  RunFigures   the headline figures of one `colibri run`/`bench` JSON (the engine's
               "colibri.metrics/1" result, which carries much more: config, plan, per-repeat runs)
  TrialResult  what the trial runner saw of one subprocess: its outcome kind + the bench JSON
  TrialRecord  a trial of the study as stored in Optuna's user_attrs ("colibri.trial/1")

A figure's field carries its column (`figure`: label, short name, kind, unit) for the column
registry (tuner/results/columns.py). The tune result that holds them is tuner/results/result.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from engine.api import SUMMARY_KEYS

TRIAL_SCHEMA = "colibri.trial/1"


def point_key(params: dict) -> str:
    """A trial's point in the search space, as an identity: stepped floats compare rounded
    (0.8500000000000001 is 0.85)."""
    return json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in params.items()}, sort_keys=True)

# How a trial ended (tuner/search/outcome.py): recorded by the trial process, or seen by its parent
# (timeout; oom_killed from the cgroup's own OOM counter; killed by another, named signal).
TrialStatus = Literal["ok", "over_budget", "oom_killed", "killed", "timeout", "crashed", "bad_config"]
# What the study makes of a trial: its runner's status, or a verdict on a completed run.
Verdict = Literal["ok", "over_budget", "oom_killed", "killed", "timeout", "crashed", "bad_config",
                  "over_budget_plan", "tokens_inconsistent", "tokens_changed",
                  "quality_bound"]  # a lossy setting outside tune --max-kl / --min-top1 (tuner/search/lossy.py)


def figure(label: str, short: str, kind: str, unit: str = "", default=None):
    """A figure field with its column (tuner/results/columns.py): label, short name, kind (how it
    reads: float, seconds, share, bytes, kl) and unit; the unit is stated in the JSON Schema."""
    meta = {"label": label, "short": short, "kind": kind, "unit": unit} if unit else \
        {"label": label, "short": short, "kind": kind}
    if default is dataclasses.MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


# --- one run --------------------------------------------------------------------------------

@dataclass
class RunFigures:
    """The headline figures of one engine run or bench (bench: medians over the repeats)."""

    decode_tok_s: Optional[float] = figure("decode tok/s", "decode", "float", "tok/s")
    ttft_s: Optional[float] = figure("TTFT s", "TTFT", "seconds", "s")
    # end to end: prefill, first token and the decode (per request)
    request_s: Optional[float] = figure("request s", "request", "seconds", "s")
    prefill_tok_s: Optional[float] = figure("prefill tok/s", "prefill", "float", "tok/s")
    token_latency_p50_ms: Optional[float] = figure("token latency p50 ms", "p50 ms", "float", "ms")
    token_latency_p99_ms: Optional[float] = figure("token latency p99 ms", "p99 ms", "float", "ms")
    read_gbps: Optional[float] = figure("read GB/s", "read", "float", "GB/s")
    io_stall_fraction: Optional[float] = figure("I/O stall", "stall", "share")
    lookahead_recall: Optional[float] = figure("lookahead recall", "recall", "share")
    bytes_read_per_token: Optional[float] = figure("read per token", "read/tok", "bytes", "B")
    hit_rate_ram: Optional[float] = figure("RAM hit rate", "hit", "share")
    peak_rss_bytes: Optional[int] = figure("peak RSS", "peak", "bytes", "B")
    plan_cache_bytes: Optional[int] = figure("planned cache", "cache", "bytes", "B")
    threads: Optional[int] = None
    tokens_consistent: Optional[bool] = None
    io_mode_effective: Optional[str] = None
    io_backend_effective: Optional[str] = None
    compute_dtype: Optional[str] = None
    load_seconds: Optional[float] = figure("load s", "load", "seconds", "s")
    # The steady workload's (engine/run/steady.py): prompts whose output looped, left out of the figure.
    degenerate_prompts: Optional[int] = figure("looping prompts", "loops", "int")
    # A trace replay's (bench --trace, tune --objective serve; engine/run/trace_replay.py), new in
    # colibri.tune/6: requests within --slo-ttft and --slo-tpot per second of the makespan, how
    # many, the tails the SLOs bound, the queue and the throughput of every sequence together.
    goodput_rps: Optional[float] = figure("goodput req/s", "goodput", "float", "req/s")
    slo_met: Optional[int] = figure("requests within the SLOs", "met", "int")
    ttft_p95_s: Optional[float] = figure("TTFT p95 s", "TTFT p95", "seconds", "s")
    tpot_p95_s: Optional[float] = figure("TPOT p95 s", "TPOT p95", "seconds", "s")
    queue_wait_p95_s: Optional[float] = figure("queue wait p95 s", "wait p95", "seconds", "s")
    aggregate_tok_s: Optional[float] = figure("aggregate tok/s", "aggregate", "float", "tok/s")

    @classmethod
    def from_metrics(cls, m: dict) -> "RunFigures":
        """From the engine's run/bench JSON; keys it lacks stay None (a resident run reads nothing)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"hit_rate_ram", "plan_cache_bytes", "degenerate_prompts"}
        return cls(**{k: m.get(k) for k in own}, hit_rate_ram=(m.get("hit_rate") or {}).get("ram"),
                   plan_cache_bytes=(m.get("plan") or {}).get("cache_bytes"),
                   degenerate_prompts=(m.get("workload") or {}).get("degenerate"))


FIGURE_NAMES = tuple(f.name for f in dataclasses.fields(RunFigures))
assert set(SUMMARY_KEYS) <= set(FIGURE_NAMES), "every summarized bench figure is a RunFigures field"


# --- one trial ------------------------------------------------------------------------------

@dataclass
class TrialResult:
    """One config run by the trial runner (tuner/search/trial.py) in a subprocess."""

    status: TrialStatus
    metrics: dict[str, Any] = field(default_factory=dict)  # the bench JSON when ok
    error: str = ""
    exception: str = ""  # crashed: the exception's type
    signal: str = ""  # killed / oom_killed: the signal's name
    cgroup_limited: bool = False
    cgroup_limit_bytes: Optional[int] = None
    cgroup_peak_bytes: Optional[int] = None
    cgroup_reason: str = ""
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TrialRecord:
    """A trial as the study stores it (Optuna user_attrs): verdict, constraint, figures, bench JSON.

    constraint <= 0 is feasible; a positive value grades how badly a config missed (the sampler
    learns 'nearly fits' from 'hopeless'). metrics holds the whole bench JSON of a run trial.
    """

    role: str
    worker: str
    config: dict[str, Any]
    status: Verdict
    constraint: float
    wall_seconds: float
    error: Optional[str] = None
    trial_status: Optional[TrialStatus] = None  # the runner's own status; None: never launched
    cgroup_limited: Optional[bool] = None
    cgroup_limit_bytes: Optional[int] = None
    cgroup_peak_bytes: Optional[int] = figure("cgroup peak", "cg peak", "bytes", "B")
    cgroup_reason: Optional[str] = None
    duplicate_of: Optional[int] = None  # an earlier trial at the same point, whose figures these are
    # The cost model's decode figure for this config, made before it ran (tuner/search/prediction.py):
    # the report sets it beside the measured one for every trial.
    predicted_decode_tok_s: Optional[float] = figure("predicted decode tok/s", "pred", "float", "tok/s")
    # tune --objective serve: the cost model's goodput on the trace (tuner/costmodel/serve_model.py), made
    # before the trial ran, evidence only (it seeds no warm start: calibration never measured it).
    predicted_goodput_rps: Optional[float] = figure("predicted goodput req/s", "pred goodput", "float", "req/s")
    figures: RunFigures = field(default_factory=RunFigures)
    output_ids: Optional[list[int]] = None
    metrics: Optional[dict[str, Any]] = None

    def to_attrs(self) -> dict:
        """Flat user_attrs: the figures at top level, so the dashboard and the CSV show them."""
        d = dataclasses.asdict(self)
        d.update(d.pop("figures"))
        # Absent means unknown: a trial that never launched has no cgroup figures, no metrics.
        return {"schema": TRIAL_SCHEMA, **{k: v for k, v in d.items() if v is not None}}

    @classmethod
    def from_attrs(cls, attrs: dict) -> "TrialRecord":
        own = {f.name for f in dataclasses.fields(cls)} - {"figures"}
        figures = RunFigures(**{k: attrs.get(k) for k in FIGURE_NAMES})
        return cls(**{k: attrs.get(k) for k in own if k in attrs or _has_default(cls, k)}, figures=figures)


def _has_default(cls, name: str) -> bool:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def is_feasible(attrs: dict) -> bool:
    """The one feasibility test: a trial that ran, was judged ok, and violates no constraint."""
    return attrs.get("constraint", 1.0) <= 0 and attrs.get("status") == "ok"
