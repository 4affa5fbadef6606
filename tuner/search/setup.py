"""One `colibri tune` session as a typed object (TuneSession), everything before its first trial.

`TuneSession.prepare()` checks every option and input and writes nothing (a refused run leaves
nothing behind): the model, the budget, the run directory's path, the storage URL, the model
facts, the user's prompts and the search space. `start()` then creates the run directory, opens
the storage, probes (or reads a saved profile) and runs the calibration trial. The search over
it (study.py's TuneRun) holds the session, and the finished session is what
assemble.build_result reads. The flow stays one-way: model facts → space → trial → study → report.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from optuna.storages import BaseStorage

from engine.api import BudgetError, ConfigError, EngineConfig, format_size, resolve_model, size_label
from tuner.base.text import utc_now
from tuner.costmodel.best_config import narrow_space
from tuner.probe import HardwareProfile, load_profile
from tuner.results import outputs
from tuner.results.result import WorkloadInfo
from tuner.search import lossy, run_guard, study_storage as storage
from tuner.search.budget import FRONT_RESERVE_RUNS, TimeBudget
from tuner.search.model_facts import ModelFacts
from tuner.search.options import Log, TuneOptions, default_budget
from tuner.search.preflight import calibrate, probe_profile
from tuner.search.run_record import RUN_FILE, read_run_record, write_run_record
from tuner.search.space import (DEFAULT_OVERHEAD_BYTES, SearchSpace, prefill_chunk_for, prefill_chunks_for,
                                prefix_caches_for)
from tuner.search.study_storage import open_storage, redact_url
from tuner.search.workload import TuneWorkload, prepare_workload, resolve_sizes


@dataclass
class TuneSession:
    """One tune session: what prepare() checked and resolved, then what start() made. Nothing
    else sets its fields; the search (study.TuneRun) keeps its own state beside it."""

    opts: TuneOptions  # validated, with the workload's sizes resolved (workload.resolve_sizes)
    log: Log
    clock: TimeBudget
    started_utc: str
    worker: str  # host:pid, recorded on every trial this process measures
    model_dir: Path
    model_name: str
    out: Path  # the run directory (start() creates it)
    budget: int
    limit_bytes: int  # the trials' memory cgroup: --cgroup-limit, else the budget
    shared: bool  # a storage other workers may join
    storage_url: str
    facts: ModelFacts
    work: TuneWorkload
    study_name: str
    has_gpu: bool
    space: SearchSpace
    quality_meter: lossy.QualityMeter | None  # tune --max-kl / --min-top1
    warm_entry: dict | None  # --from-profile's recorded config
    storage: BaseStorage | None  # a user's storage is opened by prepare(), the default one by start()
    sized_note: str = ""  # the workload's sizing, logged once the run starts
    reuse_note: str = ""  # a conversation workload's reuse and the prefix cache sizes searched
    # Made by start():
    watch: run_guard.RunDirWatch | None = None
    existing: list[str] = field(default_factory=list)  # the study names the storage held
    profile: HardwareProfile | None = None
    profile_source: str = ""
    calibration: dict = field(default_factory=dict)  # the calibration trial's facts (preflight.calibrate)

    @property
    def workload_info(self) -> WorkloadInfo:
        return self.work.info

    def __enter__(self) -> "TuneSession":
        return self

    def __exit__(self, *exc) -> None:
        if self.watch is not None:
            self.watch.close()

    # --- set-up -------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, opts: TuneOptions, log: Log) -> "TuneSession":
        """Every check of the options and inputs, writing nothing: a refused run leaves nothing behind."""
        opts = opts.validate()
        front_runs = FRONT_RESERVE_RUNS if opts.lossy is not None and opts.front_rounds else 0
        clock = TimeBudget.for_run(opts.time_budget, opts.trials, opts.confirm_top, opts.trial_timeout, front_runs)
        started_utc = utc_now()
        model_dir = resolve_model(opts.model, progress=True).resolve()
        model_name = opts.model_name or (opts.model if not Path(opts.model).exists() else model_dir.name)
        out = run_guard.tune_out(opts.out if opts.out is not None else storage.default_out(model_name, opts.resume),
                                 sources=[model_dir, opts.profile, opts.from_profile, opts.prompts, opts.trace])
        recorded = read_run_record(out) if opts.resume else None
        if opts.ram_budget is not None:
            budget = opts.ram_budget
        elif recorded:
            # Free memory moves between runs; the study was made with the budget it recorded.
            budget = recorded["budget"]
            log(f"resume: budget {format_size(budget)} as recorded in {out / RUN_FILE} "
                f"(the default here now would be {format_size(default_budget(opts.model))})")
        else:
            budget = default_budget(opts.model)
        if budget <= 0:
            raise BudgetError(f"--ram-budget must be positive, got {budget}")
        shared = storage.is_shared(opts.storage)
        storage_url = opts.storage or f"sqlite:///{(out / 'study.db').resolve()}"
        storage.check_url(storage_url)
        facts = ModelFacts.read(model_dir)
        # The workload's sizes (tuner/search/workload.py), then the user's prompts parsed before
        # anything slow (a bad file is one error line).
        opts, steady_cycle, sized_note = resolve_sizes(opts, facts, budget, DEFAULT_OVERHEAD_BYTES)
        work = prepare_workload(opts.prompts, model_dir, opts.prompt_tokens, opts.tokens,
                                facts.max_position_embeddings, steady=opts.steady_prompts
                                if opts.workload == "steady" else 0, seed=opts.seed,
                                vocab=int(facts.geometry["vocab_size"]), cycle=steady_cycle,
                                trace=opts.trace, slo=(opts.slo_ttft, opts.slo_tpot))
        min_ctx = max(opts.min_ctx, work.ctx_needed)
        if min_ctx > opts.min_ctx:
            log(f"workload: the longest request needs {min_ctx} tokens of context; --min-ctx {opts.min_ctx} raised")
        study_name = recorded_study_name(opts, recorded, out, log)
        if study_name is None:
            # tune --quant's levels carry one model name and may share one storage: the quant tells them apart.
            quant = f"-{facts.quant}" if opts.model_name else ""
            study_name = f"{model_name}{quant}-{size_label(budget, smallest='MiB')}-{opts.objective}"
        has_gpu = bool(torch.cuda.is_available())
        space, reuse_note = search_space(opts, facts, work, budget, min_ctx, has_gpu)
        quality_meter = None
        if opts.lossy is not None:  # tune --max-kl / --min-top1: lossy dimensions, each priced in quality
            space.lossy = lossy.distributions(model_dir)
            quality_meter = lossy.QualityMeter(model_dir, opts.lossy, out, log)
        if opts.resume and opts.storage is None and not (out / "study.db").exists():
            raise ConfigError(f"nothing to resume: {out} holds no study.db")
        if opts.profile:
            load_profile(opts.profile)  # refused now, not after the run directory and study exist
        warm_entry = outputs.warm_start_entry(opts.from_profile, facts.geometry, log, facts.quant) \
            if opts.from_profile else None
        return cls(
            opts=opts, log=log, clock=clock, started_utc=started_utc, worker=f"{platform.node()}:{os.getpid()}",
            model_dir=model_dir, model_name=model_name, out=out, budget=budget,
            limit_bytes=opts.cgroup_limit or budget, shared=shared, storage_url=storage_url, facts=facts,
            work=work, study_name=study_name, has_gpu=has_gpu, space=space, quality_meter=quality_meter,
            warm_entry=warm_entry,
            # A storage of the user's (PostgreSQL, or a SQLite file elsewhere) is opened now: a wrong
            # URL is refused before anything is written; the default one lives in the run directory.
            storage=open_storage(storage_url, shared) if opts.storage else None,
            sized_note=sized_note, reuse_note=reuse_note)

    def start(self) -> None:
        """Create the run directory (or reuse a previous run's) and everything up to the study."""
        opts = self.opts
        self.out.mkdir(parents=True, exist_ok=True)
        self.watch = run_guard.RunDirWatch(self.out)
        if self.sized_note:  # here, not in prepare: a refused run prints its one error line only
            self.log(self.sized_note)
        if self.reuse_note:
            self.log(self.reuse_note)
        self.work.save(self.out)
        if self.storage is None:
            self.storage = open_storage(self.storage_url, self.shared)
        self.existing = storage.check_resume(self.storage, self.storage_url, self.study_name, opts.resume,
                                             self.shared)
        write_run_record(self.out, model=opts.model, model_dir=self.model_dir, budget=self.budget,
                         study_name=self.study_name, objective=opts.objective, storage=redact_url(self.storage_url))

        self.profile, self.profile_source = probe_profile(self.out, opts.profile, self.model_dir, self.log)
        self.calibration = calibrate(
            out=self.out, model_dir=self.model_dir, budget=self.budget, limit_bytes=self.limit_bytes,
            space=self.space, has_experts=self.facts.has_experts, tokens=opts.tokens,
            prompt_tokens=opts.prompt_tokens, cold=opts.cold, seed=opts.seed, trial_timeout=opts.trial_timeout,
            record_wall=self.clock.record, log=self.log, workload_args=self.work.bench_args,
            workload=self.work.digest,
            workload_label="the steady workload's prompts of another seed" if self.work.info.kind == "steady" else None)
        self.space.overhead_bytes = self.calibration.get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES
        self.space.fit_choices()  # max_batch for serve: what the plan fits at the measured overhead
        if self.space.fitted:
            self.log("memory plan: " + "; ".join(f"{name} {', '.join(map(str, c))}"
                                                 for name, c in self.space.fitted.items()) + " fit the budget")
        hist = self.calibration.get("routing_histogram")
        self.space.with_pinned = bool(hist and Path(hist).exists())
        self.space.routing_histogram = hist or ""
        if opts.cost_model and self.study_name not in self.existing:
            region = narrow_space(self.space, self.profile)
            self.log(f"cost model: read sizes {', '.join(format_size(c) for c in region['chunk_size'])}; "
                     f"I/O threads {', '.join(map(str, region['io_threads']))} (the probe curve's rising or flat part)")

    def defaults_config(self) -> EngineConfig:
        """What a user who skips `tune` runs: EngineConfig() with this budget (and a context the
        user's minimum, or the workload's longest request, fits in)."""
        return EngineConfig(ram_budget=self.budget, ctx_size=max(EngineConfig().ctx_size, self.space.min_ctx))


def recorded_study_name(opts: TuneOptions, recorded: dict | None, out: Path, log: Log) -> str | None:
    """--study-name, or the one run.json recorded for a resume; None: derive the default."""
    if opts.study_name:
        return opts.study_name
    if recorded and opts.ram_budget is None:
        log(f"resume: study {recorded['study_name']!r} as recorded in {out / RUN_FILE}")
        return recorded["study_name"]
    return None


def search_space(opts: TuneOptions, facts: ModelFacts, work: TuneWorkload, budget: int, min_ctx: int,
                 has_gpu: bool) -> tuple[SearchSpace, str]:
    """(the space the study searches, the reuse note of a conversation workload), its budget
    checked before anything slow: a budget below the dense part is a user error."""
    longest = work.info.prompt_tokens.max
    space = SearchSpace(budget=budget, physical_cores=psutil.cpu_count(logical=False) or 1,
                        logical_cores=psutil.cpu_count() or 1, has_gpu=has_gpu, min_ctx=min_ctx, model=facts,
                        prefill_chunk=prefill_chunk_for(longest), serve=opts.objective == "serve")
    if work.info.kind in ("prompts", "conversations"):  # the user's prompts: the group is searched
        space.prefill_chunks = prefill_chunks_for(longest)
    reuse_note = ""
    reuse = work.reuse
    if reuse is not None:  # conversations: the prefix cache's RAM is searched too
        kept = facts.plan(EngineConfig(ctx_size=min_ctx, prefix_cache=1), DEFAULT_OVERHEAD_BYTES)
        space.prefix_caches = prefix_caches_for(reuse["longest_history"], reuse["conversations"],
                                                kept.kv_bytes / min_ctx)
        reuse_note = (f"workload: {reuse['conversations']} conversation(s), {reuse['shared_tokens']} of "
                      f"{reuse['prompt_tokens']} prompt tokens resent from the turn before; prefix cache "
                      f"searched at {', '.join(format_size(c) for c in space.prefix_caches)}")
    space.check_budget()
    return space, reuse_note
