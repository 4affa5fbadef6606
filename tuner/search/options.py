"""What `colibri tune` is asked to do (TuneOptions), what it hands back (TuneOutcome), and the two
choices made from the options alone: the default memory budget and the Optuna sampler.

Kept apart from study.py's run loop so the CLI, `tune --quant` and the tests can build and
validate options without importing the loop's parts.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna

from engine.base.errors import ConfigError
from tuner.search.lossy import QualityBound
from tuner.search.objective import OBJECTIVES, SAMPLERS

GiB = 1 << 30
DEMO_BUDGET = 1 * GiB  # small enough that the demo model must stream
AVAILABLE_SHARE = 0.88  # of the memory available to this process, as Colibrì's planner does

Log = Callable[[str], None]


def stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class TuneOptions:
    model: str = "demo"
    ram_budget: int | None = None  # None: 1 GiB for demo, else 88% of available memory
    time_budget: float | None = None  # seconds for the whole run; None with trials=None: 15 min
    trials: int | None = None  # measured trials in the study (resumed ones count, re-proposals do not)
    min_ctx: int = 2048
    objective: str = "decode"
    out: Path | None = None  # None: reports/tune-<model>-<timestamp> (resume: the latest one)
    storage: str | None = None  # None: sqlite file in the run directory
    study_name: str | None = None
    resume: bool = False
    from_profile: str | None = None  # warm start from the best config recorded there
    profile: str | None = None  # a saved probe to reuse instead of probing
    seed: int = 0
    # Sized for the default 15-minute run on demo (a cold trial there reads most of the model in
    # prefill); each figure is still a median over repeats, and the confirmation round re-measures.
    tokens: int = 8
    repeats: int = 2
    prompt_tokens: int = 8
    prompts: str | None = None  # the user's prompts file (tuner/search/workload.py): trials run it instead
    cold: bool = True
    trial_timeout: float | None = None  # None: adaptive (5x a measured trial, at least 60 s)
    cgroup_limit: int | None = None  # None: the budget (tests use a smaller one to force OOM)
    confirm_top: int = 3  # 0: no confirmation round (recommend the best search trial as is)
    confirm_rounds: int = 2  # at most; at least one, more while the time budget allows
    sampler: str = "auto"  # gp for one objective, tpe for two (chosen by benchmarks/tuner_quality.py)
    cost_model: bool = True  # narrow read sizes / I/O threads to the probe curve, enqueue predicted best
    # Set by `tune --quant` (tuner/search/quant_tune.py) for each level: the name the results carry (the
    # source model's, so the levels compare as one model), and the level's quality figures.
    model_name: str | None = None
    quality: dict | None = None  # tuner.result.QualityInfo as a dict
    # tune --max-kl / --min-top1: search lossy settings under this bound (tuner/search/lossy.py)
    lossy: QualityBound | None = None

    def validate(self) -> "TuneOptions":
        # NaN passes every `<= 0` test below, and inf is no time limit at all: refused first.
        for flag, value in (("--trial-timeout", self.trial_timeout), ("--time-budget", self.time_budget)):
            if value is not None and (isinstance(value, bool) or not math.isfinite(value)):
                raise ConfigError(f"{flag} must be a finite number of seconds, got {value}")
        for flag, value in (("--ram-budget", self.ram_budget), ("--cgroup-limit", self.cgroup_limit)):
            if value is not None and value <= 0:
                raise ConfigError(f"{flag} must be positive, got {value}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.trials is not None and self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ConfigError(f"--time-budget must be positive, got {self.time_budget}")
        if self.tokens < 1 or self.repeats < 1 or self.prompt_tokens < 1:
            raise ConfigError("--tokens, --repeats and --prompt-tokens must be at least 1")
        if self.min_ctx < 1:
            raise ConfigError(f"--min-ctx must be at least 1, got {self.min_ctx}")
        if self.confirm_top < 0 or self.confirm_rounds < 1:
            raise ConfigError("--confirm-top must be >= 0 and --confirm-rounds >= 1")
        if self.lossy is not None:
            self.lossy.validate()
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            raise ConfigError(f"--trial-timeout must be positive, got {self.trial_timeout}")
        return self

    @property
    def sampler_kind(self) -> str:
        if self.sampler != "auto":
            return self.sampler
        return "tpe" if self.objective == "both" else "gp"


@dataclass
class TuneOutcome:
    out_dir: Path
    result: dict
    recommended_path: Path | None
    files: dict = field(default_factory=dict)


def default_budget(model_spec: str) -> int:
    if model_spec == "demo":
        return DEMO_BUDGET
    import psutil
    from tuner.sandbox import current_memory_limit
    available = psutil.virtual_memory().available
    limit = current_memory_limit()
    if limit is not None:
        available = min(available, limit)
    return int(available * AVAILABLE_SHARE)


def make_sampler(opts: TuneOptions, shared: bool):
    seed = opts.seed
    if shared:
        # Workers of one shared study must not draw the same random points.
        seed = (seed * 1_000_003 + os.getpid()) % (2**31)
    kind = opts.sampler_kind
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "gp":
        if opts.objective == "both":
            raise ConfigError("--sampler gp handles one objective; use tpe with --objective both")
        # Chosen by measurement: replayed on a measured 36-point grid of demo configs at 9
        # evaluations, GP with 3 start-up points found the grid's best in 20 of 20 seeds,
        # TPE's median pick was 97% of it (docs/BENCHMARKS.md). It models the noise, too.
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=3)
    # TPE (multi-objective): 6 random start-up points, the warm starts among them.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6)
