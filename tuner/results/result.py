"""The result schema: one typed, versioned definition of a run's figures, a trial and a tune run.

Dataclasses, not pydantic: the hardware profile is dataclasses already, so both share one
strict loader and one JSON Schema generator (tuner/base/typed_json.py) and the tuner gains no
dependency. Every printer (tuner/results/printers.py), file (tuner/results/outputs.py) and report reads these
classes' fields, so a figure is named once. docs/schema/*.json is generated from them.

  RunFigures   the headline figures of one `colibri run`/`bench` JSON  } tuner/results/trial_record.py
  TrialResult  what the trial runner saw of one subprocess             } (re-exported here)
  TrialRecord  a trial of the study as stored in Optuna's user_attrs   }
  TuneResult   result.json of `colibri tune` ("colibri.tune/6"), with its parts and their migration

Versioning: a schema id names a version; a field added or removed is a new version. The loader
reads the current version and migrates the ones before it (`migrate`); it refuses others.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from engine.api import ConfigError
from tuner.base.typed_json import decode, with_defaults
from tuner.results.run_evidence import CostModelRun, ModeError, Reproduce  # noqa: F401  (re-exported, part of the schema)
from tuner.results.trial_record import (  # noqa: F401  (re-exported: the result schema is one import for its readers)
    FIGURE_NAMES, TRIAL_SCHEMA, RunFigures, TrialRecord, TrialResult, TrialStatus, Verdict, figure, is_feasible,
    point_key)

RESULT_SCHEMA = "colibri.tune/6"
RESULT_SCHEMA_V5 = "colibri.tune/5"
RESULT_SCHEMA_V4 = "colibri.tune/4"
RESULT_SCHEMA_V3 = "colibri.tune/3"
RESULT_SCHEMA_V2 = "colibri.tune/2"
RESULT_SCHEMA_V1 = "colibri.tune/1"
V2_ONLY_FIELDS = ("quant", "quality")  # top-level fields colibri.tune/2 added
BEST_CONFIG_SCHEMA = "colibri.best_config/1"  # a profile's record of a run's winner (tuner/share/profile_schema.py)
# Geometry keys that make two models interchangeable for a recorded best config, a fitted factor
# or a measured recall (profiles, outputs, the cost model's model facts).
GEOMETRY_KEYS = ("model_type", "layers", "hidden_size", "experts", "top_k", "moe_intermediate_size", "vocab_size")

# The figure each objective ranks by and the result's gain is on (gain_metric); both: decode
# first, then TTFT. request: the end-to-end latency of a request (TTFT + its decode), the mean
# over the workload's requests (tune --prompts) or of the fixed prompt and --tokens. serve
# (new in colibri.tune/6): goodput, the requests of a replayed trace (tune --trace) that met
# --slo-ttft and --slo-tpot per second (engine/run/trace_replay.py), ties by p95 TTFT.
Objective = Literal["decode", "ttft", "request", "both", "serve"]
OBJECTIVES = typing.get_args(Objective)  # the one list: tune --objective, result.json, shared profiles
OBJECTIVE_KEY = {"decode": "decode_tok_s", "ttft": "ttft_s", "request": "request_s", "both": "decode_tok_s",
                 "serve": "goodput_rps"}
assert tuple(OBJECTIVE_KEY) == OBJECTIVES


def _json(obj) -> dict:
    return dataclasses.asdict(obj)


def plain(part) -> dict | None:
    """A part of the typed result as result.json writes it (None stays None): for the formats
    that copy a part whole (a profile's best_configs entry, tune --quant's summary)."""
    return dataclasses.asdict(part) if part is not None else None


class ResultError(ConfigError):
    """A result file is malformed or of another schema version."""


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
    # New in colibri.tune/6, a trace replay's (tune --objective serve): medians over the runs.
    goodput_rps: Optional[float] = None
    goodput_min: Optional[float] = None
    goodput_max: Optional[float] = None
    ttft_p95_s: Optional[float] = None
    tpot_p95_s: Optional[float] = None


@dataclass
class SettingQuality:
    """A lossy setting's quality against the lossless reference (tune --max-kl / --min-top1,
    tuner/search/lossy.py), measured once per setting on the fixed text."""

    kl_mean: float = figure("KL mean", "KL", "kl", "nats", default=dataclasses.MISSING)
    kl_p99: float
    top1_agreement: float = figure("same top-1", "top-1", "share", default=dataclasses.MISSING)


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
    quality: Optional[SettingQuality] = None  # new in colibri.tune/4: its lossy setting's (None: lossless search)


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
    explored: Optional[int] = None  # measured points proposed by the exploration rule (tuner/search/explore.py)
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


WorkloadKind = Literal["steady", "fixed", "prompts", "conversations", "trace"]


@dataclass
class WorkloadInfo:
    """What the trials ran: the steady-decoding workload (engine/run/steady.py, the default), the
    fixed random prompt, the user's prompts (tune --prompts; "conversations" where its turns extend
    one another, engine/run/prompts_file.py) or a request trace replayed through serve's scheduler
    (tune --trace), described by their lengths and a hash, never their text."""

    kind: WorkloadKind
    requests: int
    prompt_tokens: Lengths
    max_new_tokens: Lengths
    sha256: Optional[str]  # of the tokenized requests (ids and output lengths); None for the fixed prompt
    source: Optional[str] = None  # the prompts file's name (no directory)
    # New in colibri.tune/5, the steady workload's: its sampler, its seed, and the cache cycle
    # (decode tokens to touch as many experts as the RAM cache holds) its length was sized from.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    cycle_tokens: Optional[float] = None
    # New in colibri.tune/6, a trace's (kind "trace"): the SLOs goodput counts against (seconds;
    # None: not bounded), its span from first to last arrival, and its sequences (n summed).
    slo_ttft_s: Optional[float] = None
    slo_tpot_s: Optional[float] = None
    span_s: Optional[float] = None
    sequences: Optional[int] = None


@dataclass
class TuneResult:
    """result.json of `colibri tune`: the recommendation, the baseline, the evidence, the conditions."""

    schema: Literal["colibri.tune/6"]
    created_utc: str
    started_utc: str
    model: ModelInfo
    budget_bytes: int
    budget: str
    objective: Objective
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
    # New in colibri.tune/5: the command that reproduces the headline figure, and the cost
    # model's predicted-vs-measured error on this run.
    reproduce: Optional[Reproduce] = None
    cost_model: Optional[CostModelRun] = None

    def to_dict(self) -> dict:
        return _json(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "result") -> "TuneResult":
        """Strict: the current schema, or a colibri.tune/1 to /5 result migrated (migrate)."""
        if isinstance(data, dict) and data.get("schema") == RESULT_SCHEMA_V1:
            # The schema id is checked against the content: a /1 file holding /2-only fields is
            # mislabelled (or edited), and migrating it would silently drop or keep them.
            newer = sorted(k for k in V2_ONLY_FIELDS if k in data)
            if newer:
                raise ResultError(f"{source}: schema says {RESULT_SCHEMA_V1} but it holds {', '.join(newer)}, "
                                  f"which only {RESULT_SCHEMA_V2} and later results have")
        if isinstance(data, dict) and data.get("schema") in OLDER_SCHEMAS:
            data = migrate(data)
        if not isinstance(data, dict) or data.get("schema") != RESULT_SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ResultError(f"{source}: not a {RESULT_SCHEMA} (or {', '.join(reversed(OLDER_SCHEMAS))}) result "
                              f"(schema {got!r})")
        return decode(cls, data, source, ResultError)


# --- migration ------------------------------------------------------------------------------

# The versions TuneResult.from_dict migrates, oldest first.
OLDER_SCHEMAS = (RESULT_SCHEMA_V1, RESULT_SCHEMA_V2, RESULT_SCHEMA_V3, RESULT_SCHEMA_V4, RESULT_SCHEMA_V5)


def migrate(data: dict) -> dict:
    """A colibri.tune/1 to /5 result as colibri.tune/6 (a new dict; the input is not changed).

    /5 → /6 added the serve objective (tune --objective serve --trace): fields with defaults only,
    a trace replay's figures in RunFigures (goodput, requests within the SLOs, p95 TTFT and TPOT,
    p95 queue wait, aggregate tok/s) and Figures (goodput and its spread, p95 TTFT and TPOT), and the
    trace's SLOs, span and sequences in WorkloadInfo (absent: None, not a trace replay). The
    objective "serve" and the workload kind "trace" are new values no older result holds.

    /4 → /5 added fields with defaults only: the steady workload's sampler, seed and cache cycle
    (WorkloadInfo), the reproduce command and the cost model's error on the run (absent: None,
    not recorded).

    /3 → /4 added each candidate's lossy-setting quality (Candidate.quality, default None: a
    lossless search, or not recorded).

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
    out = with_defaults(TuneResult, copy.deepcopy(data))
    out["schema"] = RESULT_SCHEMA
    return out
