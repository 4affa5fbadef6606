"""The result schema: one typed, versioned definition of a run's figures, a trial and a tune run.

Dataclasses, not pydantic: the hardware profile is dataclasses already, so both share one
strict loader and one JSON Schema generator (tuner/base/typed_json.py) and the tuner gains no
dependency. Every printer (tuner/results/printers.py), file (tuner/results/outputs.py) and report reads these
classes' fields, so a figure is named once. docs/schema/*.json is generated from them.

  RunFigures   the headline figures of one `colibri run`/`bench` JSON (the engine's
               "colibri.metrics/1" result, which carries much more: config, plan, per-repeat runs)
  TrialResult  what the trial runner saw of one subprocess: its outcome kind + the bench JSON
  TrialRecord  a trial of the study as stored in Optuna's user_attrs ("colibri.trial/1")
  TuneResult   result.json of `colibri tune` ("colibri.tune/3")

Versioning: a schema id names a version; a field added or removed is a new version. The loader
reads the current version and migrates the ones before it (`migrate`); it refuses others.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from engine.base.errors import ConfigError
from engine.run.metrics import SUMMARY_KEYS
from tuner.base.typed_json import decode

RESULT_SCHEMA = "colibri.tune/3"
RESULT_SCHEMA_V2 = "colibri.tune/2"
RESULT_SCHEMA_V1 = "colibri.tune/1"
V2_ONLY_FIELDS = ("quant", "quality")  # top-level fields colibri.tune/2 added
TRIAL_SCHEMA = "colibri.trial/1"
BEST_CONFIG_SCHEMA = "colibri.best_config/1"  # a profile's record of a run's winner (tuner/share/profile_schema.py)
# Geometry keys that make two models interchangeable for a recorded best config, a fitted factor
# or a measured recall (profiles, outputs, the cost model's model facts).
GEOMETRY_KEYS = ("model_type", "layers", "hidden_size", "experts", "top_k", "moe_intermediate_size", "vocab_size")

# The figure each objective ranks by and the result's gain is on (gain_metric); both: decode
# first, then TTFT. request: the end-to-end latency of a request (TTFT + its decode), the mean
# over the workload's requests (tune --prompts) or of the fixed prompt and --tokens.
OBJECTIVE_KEY = {"decode": "decode_tok_s", "ttft": "ttft_s", "request": "request_s", "both": "decode_tok_s"}


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


def _json(obj) -> dict:
    return dataclasses.asdict(obj)


class ResultError(ConfigError):
    """A result file is malformed or of another schema version."""


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
    cgroup_peak_bytes: Optional[int] = figure("cgroup peak", "cg peak", "bytes", "B")
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
    request_s: Optional[float] = None  # new in colibri.tune/3


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
    # New in colibri.tune/3 (None in older results: not recorded). `trials` counts every Optuna
    # trial; a re-proposal is the sampler proposing a measured point (told its figures, not run).
    measured_trials: Optional[int] = None  # trials that evaluated a point (bench run or memory-plan refusal)
    re_proposals: Optional[int] = None
    distinct_points: Optional[int] = None
    explored: Optional[int] = None  # measured points proposed by the exploration rule (tuner/explore.py)
    stop_reason: Optional[str] = None  # trials, time budget, converged (or interrupted before)
    measuring_seconds: Optional[float] = None  # this session's trial and confirmation runs
    measuring_share: Optional[float] = None  # of this session's wall time


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
class QualityInfo:
    """How far the tuned model's next-token distributions are from a reference's (`colibri
    quality`, engine/run/quality.py): set by `tune --quant` for each quantized level."""

    reference: str  # the reference model's name (the unquantized level), not its path
    reference_quant: str
    compute_dtype: str  # of both models (only the weights differ)
    text: str
    tokens: int
    ctx: int
    scored_tokens: int
    kl_mean: float = figure("KL mean", "KL", "kl", "nats", default=dataclasses.MISSING)
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float = figure("same top-1", "top-1", "share", default=dataclasses.MISSING)
    perplexity: float
    perplexity_reference: float


@dataclass
class Lengths:
    """Token counts over a workload's requests."""

    min: int
    median: float
    max: int
    total: int


@dataclass
class WorkloadInfo:
    """What the trials ran: the fixed random prompt, or the user's prompts (tune --prompts),
    described by their lengths and a hash, never their text."""

    kind: Literal["fixed", "prompts"]
    requests: int
    prompt_tokens: Lengths
    max_new_tokens: Lengths
    sha256: Optional[str]  # of the tokenized requests (ids and output lengths); None for the fixed prompt
    source: Optional[str] = None  # the prompts file's name (no directory)


@dataclass
class TuneResult:
    """result.json of `colibri tune`: the recommendation, the baseline, the evidence, the conditions."""

    schema: Literal["colibri.tune/3"]
    created_utc: str
    started_utc: str
    model: ModelInfo
    budget_bytes: int
    budget: str
    objective: Literal["decode", "ttft", "request", "both"]
    recommended: Optional[Candidate]
    baseline: Optional[Candidate]
    gain_over_baseline: Optional[float]
    gain_metric: str
    candidates: list[Candidate]
    confirmation: ConfirmationInfo
    study: StudyInfo
    conditions: Conditions
    # New in colibri.tune/2:
    quant: Optional[str] = None  # the tuned model's weights: int8, int4-g64, or the stored dtype (bf16)
    quality: Optional[QualityInfo] = None  # against the unquantized level (tune --quant)
    # New in colibri.tune/3: the engine's defaults as re-measured beside the baseline, the
    # headline gain over them, and the workload the trials ran.
    defaults: Optional[Candidate] = None
    gain_over_defaults: Optional[float] = None
    workload: Optional[WorkloadInfo] = None

    def to_dict(self) -> dict:
        return _json(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "result") -> "TuneResult":
        """Strict: the current schema, or a colibri.tune/1 or /2 result migrated (migrate)."""
        if isinstance(data, dict) and data.get("schema") == RESULT_SCHEMA_V1:
            # The schema id is checked against the content: a /1 file holding /2-only fields is
            # mislabelled (or edited), and migrating it would silently drop or keep them.
            newer = sorted(k for k in V2_ONLY_FIELDS if k in data)
            if newer:
                raise ResultError(f"{source}: schema says {RESULT_SCHEMA_V1} but it holds {', '.join(newer)}, "
                                  f"which only {RESULT_SCHEMA_V2} and later results have")
        if isinstance(data, dict) and data.get("schema") in (RESULT_SCHEMA_V1, RESULT_SCHEMA_V2):
            data = migrate(data)
        if not isinstance(data, dict) or data.get("schema") != RESULT_SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ResultError(f"{source}: not a {RESULT_SCHEMA} (or {RESULT_SCHEMA_V2}, {RESULT_SCHEMA_V1}) result "
                              f"(schema {got!r})")
        return decode(cls, data, source, ResultError)


# --- migration ------------------------------------------------------------------------------

def migrate(data: dict) -> dict:
    """A colibri.tune/1 or /2 result as colibri.tune/3 (a new dict; the input is not changed).

    /2 → /3 added fields with defaults only (the defaults' candidate, the gain over them, the
    workload, request_s, the study's measured/re-proposal counts): absent, they are None (not
    recorded).

    /1 files were written while the schema grew without a version bump: fields later added
    with a default (Figures.unconfirmed, RunFigures.prefill_tok_s and others in a confirmation
    run) are absent from older ones. A /1 file gets every such absent field at its default (the
    value the tuner meant when it did not write one: False for unconfirmed, None, i.e. unknown,
    for a figure) and /2's `quant` and `quality` as None (not recorded). A field without a
    default that is missing is still an error: migration fills in what was added, it does not
    repair a damaged file.
    """
    out = _with_defaults(TuneResult, copy.deepcopy(data))
    out["schema"] = RESULT_SCHEMA
    return out


def _with_defaults(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _with_defaults(inner, value)
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [_with_defaults(item, v) for v in value]
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            if f.name in value:
                value[f.name] = _with_defaults(hints[f.name], value[f.name])
            elif f.default is not dataclasses.MISSING:
                value[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value[f.name] = f.default_factory()
    return value
