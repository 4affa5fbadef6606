"""The result schema: one typed, versioned definition of a run's figures, a trial and a tune run.

Dataclasses, not pydantic: the hardware profile is dataclasses already, so both share one
strict loader and one JSON Schema generator (tuner/schema.py) and the tuner gains no
dependency. Every printer (tuner/printers.py), file (tuner/outputs.py) and report reads these
classes' fields, so a figure is named once. docs/schema/*.json is generated from them.

  RunFigures   the headline figures of one `colibri run`/`bench` JSON (the engine's
               "colibri.metrics/1" result, which carries much more: config, plan, per-repeat runs)
  TrialResult  what the trial runner saw of one subprocess: ok/oom/timeout/crash + the bench JSON
  TrialRecord  a trial of the study as stored in Optuna's user_attrs ("colibri.trial/1")
  TuneResult   result.json of `colibri tune` ("colibri.tune/1")

Versioning: a schema id names a version; a field added or removed is a new version, and the
loader refuses others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from engine.errors import ConfigError
from engine.metrics import SUMMARY_KEYS

RESULT_SCHEMA = "colibri.tune/1"
TRIAL_SCHEMA = "colibri.trial/1"
BEST_CONFIG_SCHEMA = "colibri.best_config/1"

TrialStatus = Literal["ok", "oom", "timeout", "crash"]
# What the study makes of a trial: its runner's status, or a verdict on a completed run.
Verdict = Literal["ok", "oom", "timeout", "crash", "over_budget", "over_budget_plan", "tokens_inconsistent",
                  "tokens_changed"]


def _json(obj) -> dict:
    return dataclasses.asdict(obj)


class ResultError(ConfigError):
    """A result file is malformed or of another schema version."""


# --- one run --------------------------------------------------------------------------------

@dataclass
class RunFigures:
    """The headline figures of one engine run or bench (bench: medians over the repeats)."""

    decode_tok_s: Optional[float] = None
    ttft_s: Optional[float] = None
    prefill_tok_s: Optional[float] = None
    token_latency_p50_ms: Optional[float] = None
    token_latency_p99_ms: Optional[float] = None
    read_gbps: Optional[float] = None
    io_stall_fraction: Optional[float] = None
    lookahead_recall: Optional[float] = None
    bytes_read_per_token: Optional[float] = None
    hit_rate_ram: Optional[float] = None
    peak_rss_bytes: Optional[int] = None
    plan_cache_bytes: Optional[int] = None
    threads: Optional[int] = None
    tokens_consistent: Optional[bool] = None
    io_mode_effective: Optional[str] = None
    compute_dtype: Optional[str] = None
    load_seconds: Optional[float] = None

    @classmethod
    def from_metrics(cls, m: dict) -> "RunFigures":
        """From the engine's run/bench JSON; keys it lacks stay None (a resident run reads nothing)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"hit_rate_ram", "plan_cache_bytes"}
        return cls(**{k: m.get(k) for k in own}, hit_rate_ram=(m.get("hit_rate") or {}).get("ram"),
                   plan_cache_bytes=(m.get("plan") or {}).get("cache_bytes"))


FIGURE_NAMES = tuple(f.name for f in dataclasses.fields(RunFigures))
assert set(SUMMARY_KEYS) <= set(FIGURE_NAMES), "every summarized bench figure is a RunFigures field"


# --- one trial ------------------------------------------------------------------------------

@dataclass
class TrialResult:
    """One config run by the trial runner (tuner/trial.py) in a subprocess."""

    status: TrialStatus
    metrics: dict[str, Any] = field(default_factory=dict)  # the bench JSON when ok
    error: str = ""
    cgroup_limited: bool = False
    cgroup_limit_bytes: Optional[int] = None
    cgroup_peak_bytes: Optional[int] = None
    cgroup_reason: str = ""
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return _json(self)


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
    cgroup_peak_bytes: Optional[int] = None
    cgroup_reason: Optional[str] = None
    duplicate_of: Optional[int] = None  # an earlier trial at the same point, whose figures these are
    figures: RunFigures = field(default_factory=RunFigures)
    output_ids: Optional[list[int]] = None
    metrics: Optional[dict[str, Any]] = None

    def to_attrs(self) -> dict:
        """Flat user_attrs: the figures at top level, so the dashboard and the CSV show them."""
        d = _json(self)
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


# --- the tune result ------------------------------------------------------------------------

@dataclass(kw_only=True)
class RunSummary(RunFigures):
    """One re-measurement in the confirmation round: its outcome, figures and per-repeat samples."""

    status: TrialStatus
    wall_seconds: float
    cgroup_peak_bytes: Optional[int] = None
    error: Optional[str] = None
    decode_samples: list[Optional[float]] = field(default_factory=list)
    ttft_samples: list[Optional[float]] = field(default_factory=list)


@dataclass
class Figures:
    """A candidate's figures: medians over its runs, spread over every repeat of every run."""

    decode_tok_s: Optional[float]
    ttft_s: Optional[float]
    measurements: int
    decode_min: Optional[float] = None
    decode_max: Optional[float] = None
    decode_stdev: Optional[float] = None
    ttft_min: Optional[float] = None
    ttft_max: Optional[float] = None
    samples: Optional[int] = None
    unconfirmed: bool = False  # True: the search trial's own figures (no confirmation round)


@dataclass
class Candidate:
    """A config re-measured in the confirmation round (or the best search trial, unconfirmed)."""

    label: str
    trial_number: Optional[int]
    role: Optional[str]
    config: dict[str, Any]
    confirmed: Optional[Figures]
    search_values: Optional[list[float]]
    runs: list[RunSummary]
    disqualified: Optional[str] = None
    note: Optional[str] = None


@dataclass
class ModelInfo:
    """The tuned model: its name, directory, geometry and compute dtype."""

    name: str
    dir: str
    geometry: dict[str, Any]
    compute_dtype: str


@dataclass(frozen=True)
class ConfirmationInfo:
    """How the confirmation round ran."""

    rounds: int
    confirmed: bool
    order: str = "winner first, baseline last, interleaved per round"
    figure: str = "median over rounds of each run's median over repeats; spread over all repeats"


@dataclass
class StudyInfo:
    """The Optuna study behind the result."""

    name: str
    storage: str  # password redacted
    trials: int
    feasible: int
    by_status: dict[str, int]
    sampler: str
    sampler_note: str
    directions: list[str]


@dataclass(frozen=True)
class MemoryLimit:
    """Whether the trials' memory cgroup enforced the budget, and why not where it did not."""

    cgroup_limit_bytes: int
    cgroup: Optional[bool]  # None: the calibration run did not say
    reason: str


@dataclass
class ProfileSummary:
    """The hardware profile the run used, in brief."""

    source: str
    fingerprint: str
    probe_mode: str
    storage_method: str
    disk_transport: str
    disk_model: Optional[str]
    filesystem: Optional[str]
    read_gbps_1MiB_qd4_direct: Optional[float] = None
    sequential_gbps: Optional[float] = None


@dataclass(frozen=True)
class Versions:
    """Versions of the software that measured."""

    engine: str
    git_commit: str
    optuna: str
    python: str


@dataclass
class Conditions:
    """Everything a figure depends on: cold or warm, lengths, repeats, memory limit, machine, versions."""

    cold: bool
    cold_means: str
    tokens: int
    repeats: int
    prompt_tokens: int
    seed: int
    min_ctx: int
    memory_limit: MemoryLimit
    precheck_overhead_bytes: int
    time_budget_s: Optional[float]
    wall_seconds: float
    physical_cores: int
    logical_cores: int
    gpu: bool
    profile: ProfileSummary
    search_space: dict[str, Any]
    versions: Versions


@dataclass
class TuneResult:
    """result.json of `colibri tune`: the recommendation, the baseline, the evidence, the conditions."""

    schema: Literal["colibri.tune/1"]
    created_utc: str
    started_utc: str
    model: ModelInfo
    budget_bytes: int
    budget: str
    objective: Literal["decode", "ttft", "both"]
    recommended: Optional[Candidate]
    baseline: Optional[Candidate]
    gain_over_baseline: Optional[float]
    gain_metric: str
    candidates: list[Candidate]
    confirmation: ConfirmationInfo
    study: StudyInfo
    conditions: Conditions

    def to_dict(self) -> dict:
        return _json(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "result") -> "TuneResult":
        from tuner.schema import decode
        if not isinstance(data, dict) or data.get("schema") != RESULT_SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ResultError(f"{source}: not a {RESULT_SCHEMA} result (schema {got!r})")
        return decode(cls, data, source, ResultError)
