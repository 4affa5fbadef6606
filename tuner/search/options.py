"""What `colibri tune` is asked to do (TuneOptions), what it hands back (TuneOutcome), and the two
choices made from the options alone: the default memory budget and the Optuna sampler.

Kept apart from study.py's run loop so the CLI, `tune --quant` and the tests can build and
validate options without importing the loop's parts.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna

from engine.api import CTX_MAX, ConfigError, knob
from tuner.results.result import TuneResult
from tuner.sandbox import current_memory_limit
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
    """What `colibri tune` is asked to do. Each field made with `knob` is a `tune` flag
    (colibri/commands/knob_flags.py): its kind, range, help and group are here, once."""

    model: str = knob("demo", "model directory or synth preset", kind="text")
    ram_budget: int | None = knob(None, "memory budget, e.g. 1GiB (default: 1GiB for demo, else 88% of available)",
                                  kind="size")
    # seconds for the whole run; None with trials=None: 15 min
    time_budget: float | None = knob(None, "wall time for the whole run, e.g. 10m (default 15m without --trials)",
                                     kind="duration", group="how long")
    trials: int | None = knob(None, "measured trials in the study (resumed ones count; a re-proposal of a measured "
                              "point does not)", kind="int", lo=1, hi=100_000, type_name="positive integer",
                              group="how long")
    min_ctx: int = knob(2048, "smallest context size to consider", kind="int", lo=1, hi=CTX_MAX)
    objective: str = knob("decode", "what the study ranks by: decode tok/s, TTFT, request latency, decode and "
                          "TTFT as two objectives, or serve: the goodput of a replayed --trace (requests within "
                          "--slo-ttft and --slo-tpot per second; max_batch searched too)", kind="choice",
                          choices=OBJECTIVES)
    out: Path | None = knob(None, "run directory (default: reports/tune-<model>-<time>; with --resume, the latest)",
                            kind="text", metavar="DIR", output="run directory")
    storage: str | None = knob(None, "Optuna storage URL (default: sqlite file in the run directory); "
                               "postgresql://... lets several machines share one study", kind="text")
    study_name: str | None = knob(None, "default: <model>-<budget>-<objective>", kind="text")
    resume: bool = knob(False, "continue the study in --out / --storage", kind="switch")
    from_profile: str | None = knob(None, "warm start from the best config a profile records for this model geometry",
                                    kind="path")
    profile: str | None = knob(None, "reuse a saved probe instead of probing", kind="path")
    # The calibration trial runs `bench --seed SEED+1`: the top seed (argtypes.SEED_MAX) is left for it.
    seed: int = knob(0, "sampler and prompt seed", kind="int", lo=0, hi=2**32 - 2, type_name="seed")
    # None: sized by the workload (tuner/search/workload.py): with the steady workload, a few cache
    # cycles from the memory plan (16-96 tokens) and one repeat (its prompts are the samples);
    # with the fixed prompt, 8 tokens and 2 repeats, as before.
    tokens: int | None = knob(None, "decode tokens per prompt (default: the steady workload's, a few times the "
                              "tokens that cycle the RAM cache, 16-96; 8 with --workload fixed)", kind="int", lo=1,
                              hi=CTX_MAX, type_name="positive integer", group="trial measurement")
    repeats: int | None = knob(None, "repeats per trial; the figure is their median (default: 1 with the steady "
                               "workload, whose prompts are the samples; 2 with --workload fixed)", kind="int", lo=1,
                               hi=1000, type_name="positive integer", group="trial measurement")
    workload: str = knob("steady", "what each trial runs: steady = several prompts of different lengths and seeds, "
                         "sampled, decoded over a few cache cycles, the figure their median (loops left out); "
                         "fixed = one random prompt decoded greedily (the figures before issue 43)", kind="choice",
                         choices=("steady", "fixed"), group="trial measurement")
    steady_prompts: int = knob(3, "prompts of the steady workload", kind="int", lo=1, hi=64,
                               type_name="positive integer", group="trial measurement")
    prompt_tokens: int = knob(8, "prompt length", kind="int", lo=1, hi=CTX_MAX, type_name="positive integer",
                              group="trial measurement")
    # the user's prompts file (tuner/search/workload.py): trials run it instead
    prompts: str | None = knob(None, "your workload: one prompt per line, or JSON Lines of {prompt, max_new_tokens, "
                               "conversation} (default max_new_tokens: --tokens; a conversation's turns each resend "
                               "the one before, and the prefix cache is searched); each trial runs them all, the pinned policy's "
                               "routing is recorded from them, and --objective request ranks by their end-to-end "
                               "latency", kind="path", group="trial measurement")
    # tune --objective serve (tuner/search/workload.py trace_workload): each trial replays this trace
    # through serve's scheduler (engine/run/trace_replay.py) and is judged by its goodput.
    trace: str | None = knob(None, "with --objective serve: the request trace each trial replays in wall time "
                             "(JSON Lines of {at, prompt_ids or prompt, max_tokens[, n]}, e.g. "
                             "benchmarks/serving/traces/chat_burst.jsonl)", kind="path", group="trial measurement")
    slo_ttft: float | None = knob(None, "with --objective serve: seconds from a request's arrival to its first token "
                                  "that it must not exceed to count in goodput", kind="float", lo=0.0, hi=86400.0,
                                  metavar="S", group="trial measurement")
    slo_tpot: float | None = knob(None, "with --objective serve: seconds per generated token after its first that a "
                                  "request must not exceed to count in goodput", kind="float", lo=0.0, hi=86400.0,
                                  metavar="S", group="trial measurement")
    cold: bool = knob(True, "keep caches across repeats (default: cold, weights from disk)", kind="switch",
                      flag="--warm", group="trial measurement")
    trial_timeout: float | None = knob(None, "seconds per trial (default: 5x a measured trial, >= 60)",
                                       kind="seconds", group="trial measurement")
    # None: the budget (tests use a smaller one to force OOM)
    cgroup_limit: int | None = knob(None, "trial memory cgroup limit (default: the budget)", kind="size",
                                    group="trial measurement")
    confirm_top: int = knob(3, "candidates re-measured against the baseline (0: no confirmation round)", kind="int",
                            lo=0, hi=100, type_name="non-negative integer", group="trial measurement")
    # at least one, more while the time budget allows
    confirm_rounds: int = knob(2, "most confirmation rounds (time permitting)", kind="int", lo=1, hi=100,
                               type_name="positive integer", group="trial measurement")
    # tune --max-kl: the front's points re-measured after the confirmation round (front_confirm.py)
    front_rounds: int = knob(2, "with --max-kl / --min-top1: interleaved rounds re-measuring every setting inside "
                             "the bound (and lossless) before the speed-quality front is drawn, time permitting "
                             "(0: the front from each setting's fastest search trial)", kind="int", lo=0, hi=100,
                             type_name="non-negative integer", group="trial measurement")
    # gp for one objective, tpe for two (chosen by benchmarks/tuning/tuner_quality.py)
    sampler: str = knob("auto", "auto: GP for one objective, TPE for --objective both", kind="choice",
                        choices=SAMPLERS, group="trial measurement")
    # narrow read sizes / I/O threads to the probe curve, enqueue predicted best
    cost_model: bool = knob(True, "search the full read-size / I/O-thread ranges and enqueue no predicted configs",
                            kind="switch", flag="--no-cost-model", group="trial measurement")
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
        if (self.tokens is not None and self.tokens < 1) or (self.repeats is not None and self.repeats < 1) \
                or self.prompt_tokens < 1:
            raise ConfigError("--tokens, --repeats and --prompt-tokens must be at least 1")
        if self.min_ctx < 1:
            raise ConfigError(f"--min-ctx must be at least 1, got {self.min_ctx}")
        if self.confirm_top < 0 or self.confirm_rounds < 1:
            raise ConfigError("--confirm-top must be >= 0 and --confirm-rounds >= 1")
        if isinstance(self.front_rounds, bool) or not isinstance(self.front_rounds, int) or self.front_rounds < 0:
            raise ConfigError(f"--front-rounds must be a non-negative integer, got {self.front_rounds!r}")
        if self.workload not in ("steady", "fixed"):
            raise ConfigError(f"--workload must be steady or fixed, got {self.workload!r}")
        if self.steady_prompts < 1:
            raise ConfigError(f"--steady-prompts must be at least 1, got {self.steady_prompts}")
        if self.lossy is not None:
            self.lossy.validate()
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            raise ConfigError(f"--trial-timeout must be positive, got {self.trial_timeout}")
        self._validate_serve()
        return self

    def _validate_serve(self) -> None:
        """--objective serve and --trace go together, with both SLOs (goodput means nothing without them)."""
        serve_only = [flag for flag, v in (("--trace", self.trace), ("--slo-ttft", self.slo_ttft),
                                           ("--slo-tpot", self.slo_tpot)) if v is not None]
        if self.objective != "serve":
            if serve_only:
                raise ConfigError(f"{', '.join(serve_only)} {'goes' if len(serve_only) == 1 else 'go'} with "
                                  f"--objective serve")
            return
        missing = [flag for flag in ("--trace", "--slo-ttft", "--slo-tpot") if flag not in serve_only]
        if missing:
            raise ConfigError(f"--objective serve needs {', '.join(missing)} (the trace each trial replays and the "
                              f"latency bounds its goodput counts against)")
        for flag, v in (("--slo-ttft", self.slo_ttft), ("--slo-tpot", self.slo_tpot)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{flag} must be a finite number of seconds >= 0, got {v!r}")
        if self.prompts is not None:
            raise ConfigError("--prompts and --trace are two workloads: give one")
        if self.lossy is not None:
            raise ConfigError("--max-kl / --min-top1 rank by decode speed: they do not go with --objective serve")

    @property
    def sampler_kind(self) -> str:
        if self.sampler != "auto":
            return self.sampler
        return "tpe" if self.objective == "both" else "gp"


@dataclass
class TuneOutcome:
    out_dir: Path
    tune: TuneResult  # result.json, typed: what the printers read
    recommended_path: Path | None
    files: dict = field(default_factory=dict)

    @functools.cached_property
    def result(self) -> dict:
        """result.json's JSON (what `tune --json` prints)."""
        return self.tune.to_dict()


def default_budget(model_spec: str) -> int:
    if model_spec == "demo":
        return DEMO_BUDGET
    import psutil
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
