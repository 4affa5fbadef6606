"""The set-up of one `colibri tune` session, everything before its first trial.

`prepare()` checks every option and input and writes nothing (a refused run leaves nothing
behind): the model, the budget, the run directory's path, the storage URL, the model facts, the
user's prompts and the search space. `start()` then creates the run directory, opens the
storage, probes (or reads a saved profile) and runs the calibration trial, and asks the study
(study.py) to open itself. The flow stays one-way: model facts → space → trial → study → report.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil
import torch

from engine.api import BudgetError, ConfigError, EngineConfig, format_size, resolve_model, size_label
from tuner.base.text import utc_now
from tuner.costmodel.best_config import narrow_space
from tuner.probe import load_profile
from tuner.results import outputs
from tuner.search import explore, lossy, run_guard, study_storage as storage
from tuner.search.budget import FRONT_RESERVE_RUNS, TimeBudget
from tuner.search.model_facts import ModelFacts
from tuner.search.options import Log, TuneOptions, default_budget
from tuner.search.preflight import calibrate, probe_profile
from tuner.search.run_record import RUN_FILE, read_run_record, write_run_record
from tuner.search.space import (DEFAULT_OVERHEAD_BYTES, SearchSpace, prefill_chunk_for, prefill_chunks_for,
                                prefix_caches_for)
from tuner.search.study_storage import open_storage, redact_url
from tuner.search.workload import prepare_workload, resolve_sizes


class TuneSetup:
    """One tune session before its first trial: options checked, model, budget, run directory,
    storage, workload and search space resolved (prepare), then the run directory, calibration
    and probe made (start). study._Run adds the search loop over it."""

    def __init__(self, opts: TuneOptions, log: Log):
        self.opts = opts.validate()
        self.log = log
        front_runs = FRONT_RESERVE_RUNS if opts.lossy is not None and opts.front_rounds else 0
        self.clock = TimeBudget.for_run(opts.time_budget, opts.trials, opts.confirm_top, opts.trial_timeout,
                                        front_runs)
        self.started_utc = utc_now()
        self.worker = f"{platform.node()}:{os.getpid()}"
        self.stall = explore.Stall()
        self.stop_reason = ""  # trials, time budget or converged
        self.measuring_seconds = 0.0  # this session's trial and confirmation runs (the share of wall spent measuring)
        self.reuse_note = ""  # a conversation workload's reuse and the prefix cache sizes searched

    def __enter__(self) -> "TuneSetup":
        return self

    def __exit__(self, *exc) -> None:
        if getattr(self, "watch", None) is not None:
            self.watch.close()

    # --- set-up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Every check of the options and inputs, writing nothing: a refused run leaves nothing behind."""
        opts = self.opts
        self.model_dir = resolve_model(opts.model, progress=True).resolve()
        self.model_name = opts.model_name or (opts.model if not Path(opts.model).exists() else self.model_dir.name)
        self.out = run_guard.tune_out(opts.out if opts.out is not None else
                                      storage.default_out(self.model_name, opts.resume),
                                      sources=[self.model_dir, opts.profile, opts.from_profile, opts.prompts,
                                               opts.trace])
        recorded = read_run_record(self.out) if opts.resume else None
        if opts.ram_budget is not None:
            self.budget = opts.ram_budget
        elif recorded:
            # Free memory moves between runs; the study was made with the budget it recorded.
            self.budget = recorded["budget"]
            self.log(f"resume: budget {format_size(self.budget)} as recorded in {self.out / RUN_FILE} "
                     f"(the default here now would be {format_size(default_budget(opts.model))})")
        else:
            self.budget = default_budget(opts.model)
        if self.budget <= 0:
            raise BudgetError(f"--ram-budget must be positive, got {self.budget}")
        self.limit_bytes = opts.cgroup_limit or self.budget
        self.shared = storage.is_shared(opts.storage)
        self.storage_url = opts.storage or f"sqlite:///{(self.out / 'study.db').resolve()}"
        storage.check_url(self.storage_url)
        self.facts = ModelFacts.read(self.model_dir)
        # The workload's sizes (tuner/search/workload.py), then the user's prompts parsed before
        # anything slow (a bad file is one error line).
        self.opts, self.steady_cycle, self.sized_note = resolve_sizes(opts, self.facts, self.budget, DEFAULT_OVERHEAD_BYTES)
        opts = self.opts
        self.work = prepare_workload(opts.prompts, self.model_dir, opts.prompt_tokens, opts.tokens,
                                     self.facts.max_position_embeddings, steady=opts.steady_prompts
                                     if opts.workload == "steady" else 0, seed=opts.seed,
                                     vocab=int(self.facts.geometry["vocab_size"]), cycle=self.steady_cycle,
                                     trace=opts.trace, slo=(opts.slo_ttft, opts.slo_tpot))
        self.workload_info = self.work.info
        min_ctx = max(opts.min_ctx, self.work.ctx_needed)
        if min_ctx > opts.min_ctx:
            self.log(f"workload: the longest request needs {min_ctx} tokens of context; --min-ctx {opts.min_ctx} raised")
        if not self.study_name_set(recorded):
            # tune --quant's levels carry one model name and may share one storage: the quant tells them apart.
            quant = f"-{self.facts.quant}" if opts.model_name else ""
            self.study_name = f"{self.model_name}{quant}-{size_label(self.budget, smallest='MiB')}-{opts.objective}"
        self.has_gpu = bool(torch.cuda.is_available())
        longest = self.workload_info.prompt_tokens.max
        self.space = SearchSpace(budget=self.budget, physical_cores=psutil.cpu_count(logical=False) or 1,
                                 logical_cores=psutil.cpu_count() or 1, has_gpu=self.has_gpu,
                                 min_ctx=min_ctx, model=self.facts, prefill_chunk=prefill_chunk_for(longest),
                                 serve=opts.objective == "serve")
        if self.work.info.kind in ("prompts", "conversations"):  # the user's prompts: the group is searched
            self.space.prefill_chunks = prefill_chunks_for(longest)
        reuse = self.work.reuse
        if reuse is not None:  # conversations: the prefix cache's RAM is searched too
            kept = self.facts.plan(EngineConfig(ctx_size=min_ctx, prefix_cache=1), DEFAULT_OVERHEAD_BYTES)
            self.space.prefix_caches = prefix_caches_for(reuse["longest_history"], reuse["conversations"],
                                                         kept.kv_bytes / min_ctx)
            self.reuse_note = (f"workload: {reuse['conversations']} conversation(s), {reuse['shared_tokens']} of "
                               f"{reuse['prompt_tokens']} prompt tokens resent from the turn before; prefix cache "
                               f"searched at {', '.join(format_size(c) for c in self.space.prefix_caches)}")
        self.space.check_budget()  # before anything slow: a budget below the dense part is a user error
        self.quality_meter = None
        if opts.lossy is not None:  # tune --max-kl / --min-top1: lossy dimensions, each priced in quality
            self.space.lossy = lossy.distributions(self.model_dir)
            self.quality_meter = lossy.QualityMeter(self.model_dir, opts.lossy, self.out, self.log)
        if opts.resume and opts.storage is None and not (self.out / "study.db").exists():
            raise ConfigError(f"nothing to resume: {self.out} holds no study.db")
        if opts.profile:
            load_profile(opts.profile)  # refused now, not after the run directory and study exist
        self.warm_entry = outputs.warm_start_entry(opts.from_profile, self.facts.geometry, self.log, self.facts.quant) \
            if opts.from_profile else None
        # A storage of the user's (PostgreSQL, or a SQLite file elsewhere) is opened now: a wrong
        # URL is refused before anything is written; the default one lives in the run directory.
        self.storage = open_storage(self.storage_url, self.shared) if opts.storage else None

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

    def study_name_set(self, recorded: dict | None) -> bool:
        """--study-name, or the one run.json recorded for a resume; False: derive the default."""
        if self.opts.study_name:
            self.study_name = self.opts.study_name
        elif recorded and self.opts.ram_budget is None:
            self.study_name = recorded["study_name"]
            self.log(f"resume: study {self.study_name!r} as recorded in {self.out / RUN_FILE}")
        else:
            return False
        return True
