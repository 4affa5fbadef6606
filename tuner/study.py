"""`colibri tune`: probe, search the engine's settings with Optuna, confirm, recommend.

    outcome = run_tune(TuneOptions(model="demo", trials=20))
    outcome.result["recommended"]["config"]       # also in <out>/recommended.toml

Flow (one direction): probe (or a saved profile) → search space → calibration run (the baseline
once, on another prompt: records the routing histogram the `pinned` policy needs and measures
the trial process's own memory overhead for the pre-check) → Optuna study (ask/tell; every
trial is `colibri bench` in a subprocess in a memory cgroup) → confirmation round → outputs.

Infeasible configs are COMPLETE trials with a poor but realistic objective (0 tok/s, or a TTFT
of the trial timeout) and a positive, graded constraint (`trial.set_constraint`, mirrored in
`user_attrs["constraint"]`), never FAIL: a FAIL teaches the sampler nothing. FAIL is kept for trials that were not measured at all
(interrupted, or left RUNNING by a killed run and found on resume).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from engine.config import EngineConfig, atomic_write_text, format_size
from engine.errors import BudgetError, ConfigError
from tuner import outputs
from tuner.space import DEFAULT_OVERHEAD_BYTES, ModelFacts, SearchSpace
from tuner.trial import TrialResult, run_trial

GiB = 1 << 30
DEMO_BUDGET = 1 * GiB  # small enough that the demo model must stream
AVAILABLE_SHARE = 0.88  # of the memory available to this process, as Colibrì's planner does
DEFAULT_TIME_BUDGET_S = 15 * 60  # the whole run (probe, search, confirmation) on demo, here
OBJECTIVES = ("decode", "ttft", "both")
SAMPLERS = ("auto", "gp", "tpe", "random")
STUDY_ATTR = "colibri"
MIN_TRIAL_TIMEOUT_S = 60.0
FIRST_TRIAL_TIMEOUT_S = 600.0
HEARTBEAT_S = 20  # shared storages: a worker silent for GRACE_S has its RUNNING trial failed
GRACE_S = 120

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class TuneOptions:
    model: str = "demo"
    ram_budget: int | None = None  # None: 1 GiB for demo, else 88% of available memory
    time_budget: float | None = None  # seconds for the whole run; None with trials=None: 15 min
    trials: int | None = None  # completed trials in the study (resumed ones count)
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
    cold: bool = True
    trial_timeout: float | None = None  # None: adaptive (5x a measured trial, at least 60 s)
    cgroup_limit: int | None = None  # None: the budget (tests use a smaller one to force OOM)
    confirm_top: int = 3  # 0: no confirmation round (recommend the best search trial as is)
    confirm_rounds: int = 2  # at most; at least one, more while the time budget allows
    sampler: str = "auto"  # gp for one objective, tpe for two (chosen by benchmarks/tuner_quality.py)

    def validate(self) -> "TuneOptions":
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
        if self.trial_timeout is not None and self.trial_timeout <= 0:
            raise ConfigError(f"--trial-timeout must be positive, got {self.trial_timeout}")
        return self


@dataclass
class TuneOutcome:
    out_dir: Path
    result: dict
    recommended_path: Path | None
    files: dict = field(default_factory=dict)


def parse_duration(text: str) -> float:
    """'10m', '90s', '1h30m', '45' (seconds) → seconds."""
    import re
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", s)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != s.replace(" ", ""):
        raise ConfigError(f"cannot parse duration {text!r} (examples: 10m, 90s, 1h30m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def default_budget(model_spec: str) -> int:
    if model_spec == "demo":
        return DEMO_BUDGET
    import psutil
    from engine.cgroup import current_memory_limit
    available = psutil.virtual_memory().available
    limit = current_memory_limit()
    if limit is not None:
        available = min(available, limit)
    return int(available * AVAILABLE_SHARE)


def default_out(model_name: str, resume: bool, root: Path = Path("reports")) -> Path:
    """A new run gets a new, timestamped directory (so `make tune` twice never collides);
    --resume without --out continues the latest one for this model."""
    if resume:
        runs = sorted(p for p in root.glob(f"tune-{model_name}-*") if (p / "study.db").exists())
        if not runs:
            raise ConfigError(f"nothing to resume: no earlier run for {model_name!r} under {root}/ (pass --out DIR)")
        return runs[-1]
    return root / f"tune-{model_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def redact_url(url: str) -> str:
    """A storage URL fit to print: the password replaced by ***."""
    import re
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def open_storage(url: str, shared: bool):
    """An Optuna RDB storage, or one clear error naming the URL (password hidden)."""
    kwargs = {}
    if shared and not url.startswith("sqlite"):
        kwargs = dict(heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    # Workers started together on a new database race to create Optuna's tables; the loser's
    # CREATE fails on a duplicate, and a second attempt finds the tables made.
    attempts = 1 if url.startswith("sqlite") else 4
    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                # Heartbeats are "experimental" in Optuna's words; they are what fails a dead worker's trial.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
        except Exception as exc:  # sqlalchemy and driver errors have no common base worth naming
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if attempt + 1 < attempts and ("duplicate" in first.lower() or "already exists" in first.lower()):
                time.sleep(0.5 + attempt)
                continue
            raise ConfigError(f"cannot open study storage {redact_url(url)!r}: {first[:300]}") from None


# --- the tuner ------------------------------------------------------------------------------

class _Tuner:
    def __init__(self, opts: TuneOptions, log: Log):
        self.opts = opts.validate()
        self.log = log
        self.t0 = time.monotonic()
        self.started_utc = _utc_now()
        self.walls: list[float] = []  # wall seconds of this session's measurements
        if opts.time_budget is None and opts.trials is None:
            self.time_budget = float(DEFAULT_TIME_BUDGET_S)
        else:
            self.time_budget = opts.time_budget
        self.worker = f"{platform.node()}:{os.getpid()}"

    # --- clock --------------------------------------------------------------------------------

    def used(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float | None:
        return None if self.time_budget is None else max(0.0, self.time_budget - self.used())

    def est_trial_s(self) -> float | None:
        return statistics.median(self.walls) if self.walls else None

    def trial_timeout(self) -> float:
        if self.opts.trial_timeout is not None:
            return float(self.opts.trial_timeout)
        est = self.est_trial_s()
        return FIRST_TRIAL_TIMEOUT_S if est is None else max(MIN_TRIAL_TIMEOUT_S, 5.0 * est)

    # --- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        from engine.models import resolve_model
        opts = self.opts
        self.model_dir = resolve_model(opts.model, progress=True).resolve()
        self.model_name = opts.model if not Path(opts.model).exists() else self.model_dir.name
        self.budget = opts.ram_budget if opts.ram_budget is not None else default_budget(opts.model)
        if self.budget <= 0:
            raise BudgetError(f"--ram-budget must be positive, got {self.budget}")
        self.limit_bytes = opts.cgroup_limit or self.budget
        self.out = Path(opts.out) if opts.out else default_out(self.model_name, opts.resume)
        self.shared = opts.storage is not None and not opts.storage.startswith("sqlite")
        self.storage_url = opts.storage or f"sqlite:///{(self.out / 'study.db').resolve()}"
        self.study_name = opts.study_name or f"{self.model_name}-{_size_label(self.budget)}-{opts.objective}"

        self.facts = ModelFacts.read(self.model_dir)
        import psutil
        import torch
        self.has_gpu = bool(torch.cuda.is_available())
        self.space = SearchSpace(budget=self.budget, physical_cores=psutil.cpu_count(logical=False) or 1,
                                 logical_cores=psutil.cpu_count() or 1, has_gpu=self.has_gpu,
                                 min_ctx=opts.min_ctx, model=self.facts)
        self.space.check_budget()  # before anything slow: a budget below the dense part is a user error
        if opts.resume and opts.storage is None and not (self.out / "study.db").exists():
            raise ConfigError(f"nothing to resume: {self.out} holds no study.db")
        self.out.mkdir(parents=True, exist_ok=True)
        self.storage = open_storage(self.storage_url, self.shared)  # also before anything slow
        self.existing = optuna.study.get_all_study_names(self.storage)
        if self.study_name in self.existing and not opts.resume and not self.shared:
            raise ConfigError(f"study {self.study_name!r} already exists in {redact_url(self.storage_url)}; "
                              f"pass --resume to continue it, or choose another --out or --study-name")
        if opts.resume and self.study_name not in self.existing:
            raise ConfigError(f"nothing to resume: no study {self.study_name!r} in {redact_url(self.storage_url)} "
                              f"(studies there: {', '.join(self.existing) or 'none'})")
        self.warm_entry = self._from_profile_entry() if opts.from_profile else None

        self.profile, self.profile_source = self._profile()
        self.calibration = self._calibrate()
        self.space.overhead_bytes = self.calibration.get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES
        hist = self.calibration.get("routing_histogram")
        self.space.with_pinned = bool(hist and Path(hist).exists())
        self.space.routing_histogram = hist or ""
        self.study = self._open_study()

    def _profile(self):
        from tuner.probe import load_profile, run_probe, save_profile
        cached = self.out / "profile.json"
        if self.opts.profile:
            profile = load_profile(self.opts.profile)
            if not cached.exists():
                save_profile(profile, cached)
            return profile, str(self.opts.profile)
        if cached.exists():
            return load_profile(cached), str(cached)
        self.log(f"probing the disk under {self.model_dir} and this machine (quick probe) ...")
        status = _StatusLine(self.log)
        profile = run_probe(self.model_dir, quick=True, progress=lambda i, n, label: status(f"probe {i}/{n}: {label}"))
        status.done(f"probe done in {profile.probe.duration.value:.0f} s ({profile.storage.method})")
        save_profile(profile, cached)
        return profile, str(cached)

    def _calibrate(self) -> dict:
        """The baseline once, on a different prompt (seed + 1): its routing histogram feeds the
        `pinned` policy without being an oracle of the measured prompt, and its plan gives the
        trial process's real overhead for the pre-check."""
        path = self.out / "calibration.json"
        if path.exists():
            try:
                record = json.loads(path.read_text())
                if record.get("model_dir") == str(self.model_dir) and record.get("budget") == self.budget:
                    if record.get("wall_seconds"):
                        self.walls.append(record["wall_seconds"])
                    return record
            except (OSError, json.JSONDecodeError):
                pass
        config = self.space.baseline()
        if not self.space.precheck(config)[0]:
            config = self.space.smallest()
        routing = (self.out / "routing.json").resolve() if self.facts.has_experts else None
        extra = ["--record-routing", str(routing)] if routing else []
        self.log(f"calibration: baseline config once on another prompt ({'recording routing, ' if routing else ''}"
                 f"budget {format_size(self.budget)}) ...")
        res = run_trial(self.model_dir, config, tokens=self.opts.tokens, repeats=1, cold=self.opts.cold,
                        prompt_tokens=self.opts.prompt_tokens, seed=self.opts.seed + 1, limit_bytes=self.limit_bytes,
                        timeout=self.opts.trial_timeout or FIRST_TRIAL_TIMEOUT_S, extra_args=extra)
        self.walls.append(res.wall_seconds)
        record = {"model_dir": str(self.model_dir), "budget": self.budget, "status": res.status, "error": res.error,
                  "wall_seconds": res.wall_seconds, "config": config.to_dict(),
                  "cgroup_limited": res.cgroup_limited, "cgroup_reason": res.cgroup_reason}
        if res.ok:
            record["overhead_bytes"] = (res.metrics.get("plan") or {}).get("overhead_bytes")
            record["decode_tok_s"] = res.metrics.get("decode_tok_s")
            if routing and routing.exists():
                record["routing_histogram"] = str(routing)
            self.log(f"calibration: {_fmt(res.metrics.get('decode_tok_s'))} tok/s in {res.wall_seconds:.0f} s; "
                     f"trial process overhead {format_size(record['overhead_bytes'])}"
                     + ("" if res.cgroup_limited else f"; no memory cgroup ({res.cgroup_reason})"))
        else:
            self.log(f"calibration: the baseline config did not run ({res.status}: {res.error}); "
                     f"searching without the pinned policy")
        atomic_write_text(path, json.dumps(record, indent=2) + "\n")
        return record

    def _settings(self) -> dict:
        """What a study is about: a resumed or joined study must match it."""
        return {
            "model": self.model_name,
            "geometry": {k: self.facts.geometry.get(k) for k in outputs.GEOMETRY_KEYS},
            "budget": self.budget, "objective": self.opts.objective, "space": self.space.describe(),
            "tokens": self.opts.tokens, "repeats": self.opts.repeats, "prompt_tokens": self.opts.prompt_tokens,
            "cold": self.opts.cold, "seed": self.opts.seed,
        }

    def _open_study(self) -> optuna.Study:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        directions = {"decode": ["maximize"], "ttft": ["minimize"], "both": ["maximize", "minimize"]}[self.opts.objective]
        if self.study_name in self.existing:
            # The space must be the one the study was made with (pinned or not).
            summary = optuna.load_study(study_name=self.study_name, storage=self.storage)
            recorded = summary.user_attrs.get(STUDY_ATTR)
            if recorded:
                had_pinned = "pinned" in recorded["space"].get("cache_policy", [])
                if had_pinned and not self.space.with_pinned:
                    raise ConfigError(f"study {self.study_name!r} searches cache_policy=pinned but no routing "
                                      f"histogram could be recorded here (calibration: "
                                      f"{self.calibration.get('status')})")
                self.space.with_pinned = had_pinned
        sampler = self._sampler()
        study = optuna.create_study(storage=self.storage, study_name=self.study_name, directions=directions,
                                    sampler=sampler, load_if_exists=True)
        mine = self._settings()
        recorded = study.user_attrs.get(STUDY_ATTR)
        if recorded is None:
            study.set_user_attr(STUDY_ATTR, mine)
        else:
            diff = [k for k in mine if k != "seed" and recorded.get(k) != mine[k]]
            if diff:
                detail = "; ".join(f"{k}: study has {recorded.get(k)!r}, this run {mine[k]!r}" for k in diff[:3])
                raise ConfigError(f"study {self.study_name!r} was made with other settings ({detail}); "
                                  f"use the same settings or another --study-name")
        if not self.shared:
            # SQLite is one process at a time: a RUNNING trial here was left by a killed run.
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                study.tell(t.number, state=TrialState.FAIL)
                self.log(f"resume: trial {t.number} was cut short by the interruption; recorded as FAIL (unmeasured)")
        else:
            optuna.storages.fail_stale_trials(study)
        self._enqueue_warm_starts(study)
        return study

    def _sampler(self):
        seed = self.opts.seed
        if self.shared:
            # Workers of one shared study must not draw the same random points.
            seed = (seed * 1_000_003 + os.getpid()) % (2**31)
        kind = self.sampler_kind
        if kind == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if kind == "gp":
            if self.opts.objective == "both":
                raise ConfigError("--sampler gp handles one objective; use tpe with --objective both")
            # Chosen by measurement: replayed on a measured 36-point grid of demo configs at 9
            # evaluations, GP with 3 start-up points found the grid's best in 20 of 20 seeds,
            # TPE's median pick was 97% of it (docs/BENCHMARKS.md). It models the noise, too.
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=3)
        # TPE (multi-objective): 6 random start-up points, the warm starts among them.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6)

    @property
    def sampler_kind(self) -> str:
        if self.opts.sampler != "auto":
            return self.opts.sampler
        return "tpe" if self.opts.objective == "both" else "gp"

    def _from_profile_entry(self) -> dict | None:
        from tuner.probe import load_profile
        profile = load_profile(self.opts.from_profile)
        matches = [e for e in profile.best_configs
                   if isinstance(e, dict) and outputs.same_geometry(e.get("geometry"), self.facts.geometry)
                   and isinstance(e.get("config"), dict)]
        if not matches:
            self.log(f"--from-profile: {self.opts.from_profile} records no config for this model geometry; "
                     f"warm start from the baseline only")
            return None
        return max(matches, key=lambda e: ((e.get("figures") or {}).get("decode_tok_s") or 0.0))

    def _enqueue_warm_starts(self, study: optuna.Study) -> None:
        study.enqueue_trial(self.space.params_of(self.space.baseline()), user_attrs={"role": "baseline"},
                            skip_if_exists=True)
        if self.warm_entry:
            try:
                config = EngineConfig.from_dict(self.warm_entry["config"], source="--from-profile config")
            except ConfigError as exc:
                self.log(f"--from-profile: skipped an unusable recorded config ({exc})")
                return
            study.enqueue_trial(self.space.params_of(config), user_attrs={"role": "from_profile"},
                                skip_if_exists=True)

    # --- search -------------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
        done = sum(t.state == TrialState.COMPLETE for t in trials)
        return done, len(trials) - done

    def search(self) -> None:
        opts = self.opts
        while True:
            if self.shared:
                optuna.storages.fail_stale_trials(self.study)
            done, running = self.counts()
            if opts.trials is not None and done + running >= opts.trials:
                break
            if not self._time_for_another():
                self.log(f"time budget: no room for another trial ({_clock(self.used())} used); confirming")
                break
            trial = self.study.ask()
            try:
                with _Heartbeat(self.storage, trial, enabled=self.shared):
                    values, attrs = self.evaluate(trial)
            except BaseException:
                # Not measured: FAIL is the honest state (the sampler must not learn from it).
                try:
                    self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                except Exception:
                    pass
                raise
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            # Optuna 5 samplers read constraints set on the trial (constraints_func is deprecated).
            trial.set_constraint("violation", attrs["constraint"])
            self.study.tell(trial, values)
            self.progress(trial.number, attrs)
            self._write_trials_csv()

    def _time_for_another(self) -> bool:
        left = self.left()
        if left is None:
            return True
        est = self.est_trial_s() or 0.0
        reserve = est * (min(self.opts.confirm_top, 3) + 1) if self.opts.confirm_top else 0.0
        return left >= est + reserve

    def evaluate(self, trial: optuna.Trial) -> tuple[list[float], dict]:
        config = self.space.suggest(trial)
        role = trial.user_attrs.get("role", "search")
        attrs = {"role": role, "worker": self.worker, "config": config.to_dict()}
        earlier = self._same_point(trial.params)
        if earlier is not None:
            # TPE re-proposes points of a small categorical space; a re-run would spend a whole
            # trial on one more sample of a known point (the confirmation round re-measures anyway).
            attrs.update({k: v for k, v in earlier.user_attrs.items() if k not in ("role", "worker")})
            attrs["duplicate_of"] = earlier.number
            return list(earlier.values), attrs
        fits, overshoot, message = self.space.precheck(config)
        if not fits:
            attrs.update(status="over_budget_plan", constraint=round(overshoot / self.budget, 6), error=message,
                         wall_seconds=0.0)
            return self._worst_values(), attrs
        res = self.measure(config)
        attrs.update(_result_attrs(res))
        status, constraint, error = self.judge(config, res)
        attrs.update(status=status, constraint=constraint)
        if error:
            attrs["error"] = error
        if constraint > 0:
            return self._worst_values(), attrs
        m = res.metrics
        decode = float(m.get("decode_tok_s") or 0.0)
        ttft = m.get("ttft_s")
        ttft = float(ttft) if ttft is not None else self.trial_timeout()
        return {"decode": [decode], "ttft": [ttft], "both": [decode, ttft]}[self.opts.objective], attrs

    def _same_point(self, params: dict):
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.params == params and "constraint" in t.user_attrs and t.values is not None:
                return t
        return None

    def measure(self, config: EngineConfig, seed: int | None = None) -> TrialResult:
        timeout = self.trial_timeout()
        res = run_trial(self.model_dir, config, tokens=self.opts.tokens, repeats=self.opts.repeats,
                        cold=self.opts.cold, prompt_tokens=self.opts.prompt_tokens,
                        seed=self.opts.seed if seed is None else seed, limit_bytes=self.limit_bytes, timeout=timeout)
        if res.status != "timeout":
            self.walls.append(res.wall_seconds)
        return res

    def judge(self, config: EngineConfig, res: TrialResult) -> tuple[str, float, str]:
        """(status, constraint, error): constraint <= 0 is feasible; the size of a violation
        grades how bad it was, so the sampler can tell 'nearly fits' from 'hopeless'."""
        if res.status == "oom":
            peak = res.cgroup_peak_bytes or res.cgroup_limit_bytes or self.limit_bytes
            return "oom", round(0.05 + max(0, peak - self.budget) / self.budget, 6), res.error
        if res.status == "timeout":
            return "timeout", 0.05, res.error
        if res.status != "ok":
            if "memory budget" in res.error:  # the engine's own plan refused it: over budget
                return "over_budget", 0.05, res.error
            return "crash", 0.5, res.error
        m = res.metrics
        if not m.get("tokens_consistent", True):
            return "tokens_inconsistent", 1.0, "output tokens differ between repeats of one config"
        ref = self.reference_tokens(m.get("threads"))
        if ref is not None and m.get("output_ids") != ref:
            return "tokens_changed", 1.0, (f"output tokens differ from the first trial with {m.get('threads')} "
                                           f"threads (placement must never change tokens)")
        peak = m.get("peak_rss_bytes") or 0
        if not res.cgroup_limited and peak > self.budget:
            # Without a cgroup nothing else enforces the budget: the process's own peak must fit.
            return "over_budget", round((peak - self.budget) / self.budget, 6), \
                f"peak RSS {format_size(peak)} over the budget {format_size(self.budget)}"
        return "ok", 0.0, ""

    def reference_tokens(self, threads) -> list | None:
        for t in sorted(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
            a = t.user_attrs
            if a.get("status") == "ok" and a.get("threads") == threads and a.get("output_ids") is not None:
                return a["output_ids"]
        return None

    def _worst_values(self) -> list[float]:
        worst_ttft = float(self.trial_timeout())
        return {"decode": [0.0], "ttft": [worst_ttft], "both": [0.0, worst_ttft]}[self.opts.objective]

    def progress(self, number: int, attrs: dict) -> None:
        done, _ = self.counts()
        total = str(self.opts.trials) if self.opts.trials else f"~{done + self._trials_left_estimate()}"
        if attrs.get("constraint", 1) > 0:
            figure = f"{attrs.get('status')} (infeasible)"
        elif self.opts.objective == "ttft":
            figure = f"TTFT {_fmt(attrs.get('ttft_s'), 3)} s"
        else:
            figure = f"{_fmt(attrs.get('decode_tok_s'))} tok/s"
        if attrs.get("duplicate_of") is not None:
            figure += f" (= trial {attrs['duplicate_of']}, not re-run)"
        best = self.best_feasible()
        best_txt = ""
        if best is not None:
            a = best.user_attrs
            key = "ttft_s" if self.opts.objective == "ttft" else "decode_tok_s"
            best_txt = f" (best {_fmt(a.get(key), 3 if key == 'ttft_s' else 2)}, trial {best.number})"
        left = self.left()
        clock = f"{_clock(self.used())} used" + (f", {_clock(left)} left" if left is not None else "")
        self.log(f"trial {done}/{total} [#{number} {attrs.get('role')}] | {figure}{best_txt} | {clock}")

    def _trials_left_estimate(self) -> int:
        left, est = self.left(), self.est_trial_s()
        if left is None or not est:
            return 0
        reserve = est * (min(self.opts.confirm_top, 3) + 1) if self.opts.confirm_top else 0.0
        return max(0, int((left - reserve) // est))

    def feasible_trials(self) -> list:
        return [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get("constraint", 1.0) <= 0 and t.user_attrs.get("status") == "ok"]

    def best_feasible(self):
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def ranked(self) -> list:
        """Feasible trials best first. Both objectives: the Pareto front first (by decode), then
        the rest by decode."""
        feas = self.feasible_trials()
        if self.opts.objective == "decode":
            return sorted(feas, key=lambda t: -t.values[0])
        if self.opts.objective == "ttft":
            return sorted(feas, key=lambda t: t.values[0])
        front = [t for t in feas if not any(_dominates(o, t) for o in feas)]
        rest = [t for t in feas if t not in front]
        return sorted(front, key=lambda t: (-t.values[0], t.values[1])) + sorted(rest, key=lambda t: -t.values[0])

    # --- confirmation -------------------------------------------------------------------------

    def confirm(self) -> dict:
        """Re-measure the top candidates and the baseline, interleaved, winner first and baseline
        last (leftover warm state then favours the baseline, not the winner); choose on medians."""
        opts = self.opts
        ranked = self.ranked()
        baseline_cfg = self.space.baseline()
        baseline_params = self.space.params_of(baseline_cfg)
        baseline_trial = next((t for t in sorted(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
                                                 key=lambda t: t.number)
                               if t.params == baseline_params), None)
        seen, cands = [], []
        for t in ranked:
            key = json.dumps(t.params, sort_keys=True)
            if key in seen or t.params == baseline_params:
                continue
            seen.append(key)
            cands.append(t)
            if len(cands) >= opts.confirm_top:
                break
        entries = [{"label": f"trial {t.number}", "trial_number": t.number, "role": t.user_attrs.get("role", "search"),
                    "config": self.space.config_from_params(t.params), "search_values": list(t.values), "runs": []}
                   for t in cands]
        entries.append({"label": "baseline", "trial_number": baseline_trial.number if baseline_trial else None,
                        "role": "baseline", "config": baseline_cfg,
                        "search_values": list(baseline_trial.values) if baseline_trial else None, "runs": []})
        if opts.confirm_top == 0:
            return self._unconfirmed(ranked, entries[-1], baseline_trial)
        rounds = 0
        while rounds < opts.confirm_rounds:
            if rounds >= 1:
                left, est = self.left(), self.est_trial_s() or 0.0
                if left is not None and left < est * len(entries):
                    break
            rounds += 1
            for i, e in enumerate(entries):
                self.log(f"confirm round {rounds}: {i + 1}/{len(entries)} {e['label']} ...")
                res = self.measure(e["config"])
                e["runs"].append(_run_summary(res))
                last = e["runs"][-1]
                self.log(f"confirm round {rounds}: {e['label']}: " + (
                    f"{_fmt(last.get('decode_tok_s'))} tok/s, TTFT {_fmt(last.get('ttft_s'), 3)} s"
                    if last["status"] == "ok" else last["status"]))
        return self._decide(entries, rounds)

    def _decide(self, entries: list[dict], rounds: int) -> dict:
        base = entries[-1]
        base_fig = _figures(base["runs"])
        for e in entries:
            e["confirmed"] = _figures(e["runs"])
            bad = [r for r in e["runs"] if r["status"] != "ok"]
            if bad:
                e["disqualified"] = f"{bad[0]['status']} in confirmation: {bad[0].get('error', '')}"[:300]
            elif not all(r.get("tokens_consistent", True) for r in e["runs"]):
                e["disqualified"] = "output tokens differ between repeats"
            elif e is not base and base_fig and base["runs"] and base["runs"][0]["status"] == "ok":
                same_threads = e["runs"][0].get("threads") == base["runs"][0].get("threads")
                if e["runs"][0].get("output_ids") != base["runs"][0].get("output_ids"):
                    if same_threads:
                        e["disqualified"] = "output tokens differ from the baseline's (placement must not change them)"
                    else:
                        e["note"] = ("output tokens differ from the baseline's, whose thread count differs "
                                     "(float reduction order); not disqualified")
        ok = [e for e in entries if not e.get("disqualified") and e["confirmed"]]
        winner = None
        if ok:
            if self.opts.objective == "ttft":
                winner = min(ok, key=lambda e: e["confirmed"]["ttft_s"] if e["confirmed"]["ttft_s"] is not None
                             else float("inf"))
            else:
                winner = max(ok, key=lambda e: (e["confirmed"]["decode_tok_s"] or 0.0,
                                                -(e["confirmed"]["ttft_s"] or 0.0)))
        return {"entries": entries, "rounds": rounds, "winner": winner, "baseline": base, "confirmed": True}

    def _unconfirmed(self, ranked, base_entry, baseline_trial) -> dict:
        entries = []
        for t in ranked[:1]:
            entries.append({"label": f"trial {t.number}", "trial_number": t.number, "role": t.user_attrs.get("role"),
                            "config": self.space.config_from_params(t.params), "search_values": list(t.values),
                            "runs": [], "confirmed": _figures_from_attrs(t.user_attrs)})
        base_entry["confirmed"] = _figures_from_attrs(baseline_trial.user_attrs) \
            if baseline_trial is not None and baseline_trial.user_attrs.get("status") == "ok" else {}
        winner = entries[0] if entries else None
        return {"entries": entries + [base_entry], "rounds": 0, "winner": winner, "baseline": base_entry,
                "confirmed": False}

    # --- outputs ------------------------------------------------------------------------------

    def _write_trials_csv(self) -> None:
        from tuner.trials_frame import write_trials_csv
        write_trials_csv(self.study, self.out / "trials.csv")

    def result(self, decision: dict) -> dict:
        winner, base = decision["winner"], decision["baseline"]
        wfig, bfig = (winner or {}).get("confirmed") or {}, base.get("confirmed") or {}
        gain = None
        key = "ttft_s" if self.opts.objective == "ttft" else "decode_tok_s"
        if winner and wfig.get(key) and bfig.get(key):
            gain = (bfig[key] / wfig[key] - 1.0) if key == "ttft_s" else (wfig[key] / bfig[key] - 1.0)
        trials = self.study.get_trials(deepcopy=False)
        statuses: dict[str, int] = {}
        for t in trials:
            s = t.user_attrs.get("status", t.state.name.lower())
            statuses[s] = statuses.get(s, 0) + 1
        compute_dtype = self._compute_dtype()

        def entry(e):
            if e is None:
                return None
            return {"label": e["label"], "trial_number": e["trial_number"], "role": e.get("role"),
                    "config": e["config"].to_dict(), "confirmed": e.get("confirmed"),
                    "search_values": e.get("search_values"), "runs": [_strip_run(r) for r in e["runs"]],
                    "disqualified": e.get("disqualified"), "note": e.get("note")}

        return {
            "schema": outputs.RESULT_SCHEMA,
            "created_utc": _utc_now(),
            "started_utc": self.started_utc,
            "model": {"name": self.model_name, "dir": str(self.model_dir), "geometry": self.facts.geometry,
                      "compute_dtype": compute_dtype},
            "budget_bytes": self.budget,
            "budget": format_size(self.budget),
            "objective": self.opts.objective,
            "recommended": entry(winner),
            "baseline": entry(base),
            "gain_over_baseline": gain,
            "gain_metric": key,
            "candidates": [entry(e) for e in decision["entries"]],
            "confirmation": {"rounds": decision["rounds"], "confirmed": decision["confirmed"],
                             "order": "winner first, baseline last, interleaved per round",
                             "figure": "median over rounds of each run's median over repeats; spread over all repeats"},
            "study": {"name": self.study_name, "storage": redact_url(self.storage_url),
                      "trials": len(trials), "feasible": len(self.feasible_trials()), "by_status": statuses,
                      "sampler": type(self.study.sampler).__name__,
                      "sampler_note": "chosen by benchmarks/tuner_quality.py (GP for one objective, TPE for two)"
                      if self.opts.sampler == "auto" else "set by --sampler", "directions": [d.name for d in self.study.directions]},
            "conditions": {
                "cold": self.opts.cold,
                "cold_means": ("the model's pages are dropped from the page cache and the engine's caches emptied "
                               "before every repeat: weights come from disk") if self.opts.cold else
                              "warm: caches persist across repeats",
                "tokens": self.opts.tokens, "repeats": self.opts.repeats, "prompt_tokens": self.opts.prompt_tokens,
                "seed": self.opts.seed, "min_ctx": self.opts.min_ctx,
                "memory_limit": {"cgroup_limit_bytes": self.limit_bytes,
                                 "cgroup": self.calibration.get("cgroup_limited"),
                                 "reason": self.calibration.get("cgroup_reason") or ""},
                "precheck_overhead_bytes": self.space.overhead_bytes,
                "time_budget_s": self.time_budget, "wall_seconds": round(self.used(), 1),
                "physical_cores": self.space.physical_cores, "logical_cores": self.space.logical_cores,
                "gpu": self.has_gpu, "profile": self._profile_summary(),
                "search_space": self.space.describe(),
                "versions": _versions(),
            },
        }

    def _compute_dtype(self) -> str:
        try:
            _, _, _, dtype = self.space._inputs()
            return str(dtype).replace("torch.", "")
        except Exception:
            return ""

    def _profile_summary(self) -> dict:
        p = self.profile
        out = {"source": self.profile_source, "fingerprint": p.fingerprint, "probe_mode": p.probe.mode,
               "storage_method": p.storage.method, "disk_transport": p.system.disk.transport,
               "disk_model": p.system.disk.model, "filesystem": p.system.disk.filesystem}
        try:
            out["read_gbps_1MiB_qd4_direct"] = round(p.read_bandwidth(1 << 20, 4) / 1e9, 3)
        except Exception:
            pass
        seq = p.storage_point("sequential")
        if seq is not None:
            out["sequential_gbps"] = round(seq.bandwidth.value / 1e9, 3)
        return out

    def write_outputs(self, result: dict) -> dict:
        files = {}
        self._write_trials_csv()
        files["trials.csv"] = self.out / "trials.csv"
        rec = result.get("recommended")
        if rec:
            config = EngineConfig.from_dict(rec["config"], source="recommended config")
            files["recommended.toml"] = outputs.write_recommended_toml(config, result, self.out / "recommended.toml")
        files["result.json"] = outputs.write_result_json(result, self.out / "result.json")
        try:
            from tuner.report import write_report
            files.update(write_report(self.study, result, self.out))
            from tuner.report_html import write_html_report
            files["report.html"] = write_html_report(self.out, study=self.study)
        except Exception as exc:  # the numbers are saved; a plotting problem must not lose them
            self.log(f"report: could not be written ({type(exc).__name__}: {exc})")
        if rec:
            self._update_profile(result)
            files["profile.json"] = self.out / "profile.json"
        return files

    def _update_profile(self, result: dict) -> None:
        from tuner.probe import save_profile
        entry = outputs.best_config_entry(result)
        keep = [e for e in self.profile.best_configs
                if not (isinstance(e, dict) and outputs.same_geometry(e.get("geometry"), entry["geometry"])
                        and e.get("ram_budget") == entry["ram_budget"] and e.get("objective") == entry["objective"])]
        self.profile.best_configs = keep + [entry]
        save_profile(self.profile, self.out / "profile.json")


def run_tune(opts: TuneOptions, log: Log = _stderr) -> TuneOutcome:
    from tuner.probe.storage import sigterm_as_interrupt
    tuner = _Tuner(opts, log)
    with sigterm_as_interrupt():  # `kill` gets the same clean stop as Ctrl-C
        tuner.setup()
        done, _ = tuner.counts()
        log(f"study {tuner.study_name!r} in {redact_url(tuner.storage_url)}: {done} completed trial(s) so far; "
            f"budget {format_size(tuner.budget)}, objective {opts.objective}, "
            + (f"{opts.trials} trials" if opts.trials else "")
            + (", " if opts.trials and tuner.time_budget else "")
            + (f"time budget {_clock(tuner.time_budget)}" if tuner.time_budget else ""))
        try:
            tuner.search()
            decision = tuner.confirm()
        except KeyboardInterrupt:
            done, _ = tuner.counts()
            tuner._write_trials_csv()
            again = (f"colibri tune --resume --model {opts.model} --out {tuner.out} --study-name {tuner.study_name}"
                     + (f" --storage {redact_url(tuner.storage_url)}" if opts.storage else ""))
            log(f"interrupted: {done} completed trial(s) are saved in {redact_url(tuner.storage_url)}; "
                f"continue with: {again}")
            raise
        result = tuner.result(decision)
        files = tuner.write_outputs(result)
    rec = result["recommended"]
    if rec is None:
        raise BudgetError(f"no configuration ran within the budget {format_size(tuner.budget)} "
                          f"({result['study']['by_status']}); see {tuner.out / 'trials.csv'}")
    return TuneOutcome(out_dir=tuner.out, result=result, recommended_path=files.get("recommended.toml"), files=files)


def format_outcome(outcome: TuneOutcome) -> str:
    r = outcome.result
    rec, base = r["recommended"], r["baseline"]
    wf, bf = rec.get("confirmed") or {}, (base or {}).get("confirmed") or {}
    c = rec["config"]
    lines = [
        f"recommended ({rec['label']}, {'confirmed' if r['confirmation']['confirmed'] else 'unconfirmed'} over "
        f"{r['confirmation']['rounds']} round(s)): decode {_fmt(wf.get('decode_tok_s'))} tok/s "
        f"[{_fmt(wf.get('decode_min'))}..{_fmt(wf.get('decode_max'))}], TTFT {_fmt(wf.get('ttft_s'), 3)} s",
        f"baseline: decode {_fmt(bf.get('decode_tok_s'))} tok/s [{_fmt(bf.get('decode_min'))}.."
        f"{_fmt(bf.get('decode_max'))}], TTFT {_fmt(bf.get('ttft_s'), 3)} s"
        + (f" ({base.get('disqualified')})" if base and base.get("disqualified") else ""),
        f"gain over baseline ({r['gain_metric']}): "
        + ("-" if r["gain_over_baseline"] is None else f"{r['gain_over_baseline']:+.1%}"),
        f"config: chunk {format_size(c['chunk_size'])}, prefetch {c['prefetch_depth']}, cache {c['cache_policy']} "
        f"x{c['cpu_cache_ratio']}, threads {c['threads']}, io {c['io_mode']} x{c['io_threads']}, ctx {c['ctx_size']}",
        f"trials: {r['study']['trials']} ({r['study']['feasible']} feasible) | {r['budget']} budget | "
        f"{'cold' if r['conditions']['cold'] else 'warm'} | {r['conditions']['wall_seconds']:.0f} s",
    ]
    for name in ("recommended.toml", "result.json", "trials.csv", "report.md", "report.html"):
        if name in outcome.files:
            lines.append(f"  {name}: {outcome.files[name]}")
    lines.append(f"  study: {r['study']['storage']} (optuna-dashboard can open it)")
    return "\n".join(lines)


# --- helpers --------------------------------------------------------------------------------

def _dominates(a, b) -> bool:
    (ad, at), (bd, bt) = a.values, b.values
    return ad >= bd and at <= bt and (ad > bd or at < bt)


RESULT_SCALARS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "token_latency_p50_ms", "token_latency_p99_ms",
                  "read_gbps", "io_stall_fraction", "lookahead_recall", "bytes_read_per_token", "peak_rss_bytes",
                  "threads", "tokens_consistent", "io_mode_effective", "compute_dtype", "load_seconds")


def _result_attrs(res: TrialResult) -> dict:
    """Every metric of the bench JSON (as `metrics`), plus the headline figures on their own so
    the dashboard and the CSV can show them."""
    a = {"trial_status": res.status, "wall_seconds": round(res.wall_seconds, 3), "cgroup_limited": res.cgroup_limited,
         "cgroup_limit_bytes": res.cgroup_limit_bytes, "cgroup_peak_bytes": res.cgroup_peak_bytes,
         "cgroup_reason": res.cgroup_reason}
    if res.error:
        a["error"] = res.error
    if res.ok:
        m = res.metrics
        for k in RESULT_SCALARS:
            a[k] = m.get(k)
        a["output_ids"] = m.get("output_ids")
        a["hit_rate_ram"] = (m.get("hit_rate") or {}).get("ram")
        a["plan_cache_bytes"] = (m.get("plan") or {}).get("cache_bytes")
        a["metrics"] = m
    return a


def _run_summary(res: TrialResult) -> dict:
    out = {"status": res.status, "wall_seconds": round(res.wall_seconds, 3), "cgroup_peak_bytes": res.cgroup_peak_bytes}
    if not res.ok:
        out["error"] = res.error
        return out
    m = res.metrics
    out.update({
        "decode_tok_s": m.get("decode_tok_s"), "ttft_s": m.get("ttft_s"),
        "decode_samples": [r.get("decode_tok_s") for r in m.get("runs", [])],
        "ttft_samples": [r.get("ttft_s") for r in m.get("runs", [])],
        "output_ids": m.get("output_ids"), "tokens_consistent": m.get("tokens_consistent", True),
        "threads": m.get("threads"), "hit_rate_ram": (m.get("hit_rate") or {}).get("ram"),
        "io_stall_fraction": m.get("io_stall_fraction"), "peak_rss_bytes": m.get("peak_rss_bytes"),
    })
    return out


def _strip_run(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "output_ids"}


def _figures(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {}

    def med(key):
        vals = [r[key] for r in ok if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    dec = [v for r in ok for v in r.get("decode_samples") or [] if v is not None]
    ttft = [v for r in ok for v in r.get("ttft_samples") or [] if v is not None]
    return {
        "decode_tok_s": med("decode_tok_s"), "ttft_s": med("ttft_s"), "measurements": len(ok),
        "decode_min": min(dec) if dec else None, "decode_max": max(dec) if dec else None,
        "decode_stdev": statistics.stdev(dec) if len(dec) > 1 else 0.0,
        "ttft_min": min(ttft) if ttft else None, "ttft_max": max(ttft) if ttft else None,
        "samples": len(dec),
    }


def _figures_from_attrs(a: dict) -> dict:
    m = a.get("metrics") or {}
    s = (m.get("summary") or {}).get("decode_tok_s") or {}
    t = (m.get("summary") or {}).get("ttft_s") or {}
    return {"decode_tok_s": a.get("decode_tok_s"), "ttft_s": a.get("ttft_s"), "measurements": 1,
            "decode_min": s.get("min"), "decode_max": s.get("max"), "decode_stdev": s.get("stdev"),
            "ttft_min": t.get("min"), "ttft_max": t.get("max"), "samples": s.get("n"), "unconfirmed": True}


class _Heartbeat:
    """Shared storages only: tell the others this worker's RUNNING trial is alive, so a killed
    worker's trial is failed by `fail_stale_trials` instead of staying RUNNING forever."""

    def __init__(self, storage, trial, enabled: bool):
        self.enabled = enabled and hasattr(storage, "record_heartbeat")
        self.storage, self.trial = storage, trial
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.enabled:
            # Optuna exposes a trial's storage id only as `_trial_id`; its own optimize() uses it.
            trial_id = self.trial._trial_id
            self.storage.record_heartbeat(trial_id)

            def beat():
                while not self._stop.wait(HEARTBEAT_S):
                    try:
                        self.storage.record_heartbeat(trial_id)
                    except Exception:
                        pass

            self._thread = threading.Thread(target=beat, daemon=True, name="colibri-heartbeat")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class _StatusLine:
    """A one-line status on a terminal (rewritten in place); nothing but the last line elsewhere."""

    def __init__(self, log: Log):
        self.log = log
        self.tty = sys.stderr.isatty() and log is _stderr

    def __call__(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text[:150])
            sys.stderr.flush()

    def done(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
        self.log(text)


def _versions() -> dict:
    from engine import __version__ as engine_version
    from engine.metrics import git_commit
    return {"engine": engine_version, "git_commit": git_commit(), "optuna": optuna.__version__,
            "python": platform.python_version()}


def _size_label(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n // (1 << 20)}MiB"


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def _fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


__all__ = ["TuneOptions", "TuneOutcome", "run_tune", "format_outcome", "parse_duration", "default_budget",
           "open_storage", "redact_url"]
