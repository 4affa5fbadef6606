"""`colibri tune`: probe, search the engine's settings with Optuna, confirm, recommend.

    outcome = run_tune(TuneOptions(model="demo", trials=20))
    outcome.result["recommended"]["config"]       # also in <out>/recommended.toml

Flow (one direction): probe (or a saved profile) → search space → calibration run
(calibrate.py) → Optuna study (ask/tell; every trial is `colibri bench` in a subprocess in a
memory cgroup, judged by objective.py) → confirmation round (confirm.py) → outputs
(outputs.py). The session itself, one typed object (every check, then the run directory,
storage, probe and calibration), is setup.py's TuneSession; this module's TuneRun holds it and
keeps the Optuna study and the loop that ties those parts together; the time budget is
budget.py's, the storage and resume rules study_storage.py's.

FAIL is kept for trials that were not measured at all (interrupted, or left RUNNING by a killed
run and found on resume); everything measured, feasible or not, is COMPLETE (objective.py).
"""

from __future__ import annotations

import dataclasses

import optuna
from optuna.trial import TrialState

from engine.api import BudgetError, ConfigError, EngineConfig, format_size
from tuner.base import interrupts
from tuner.results import outputs
from tuner.results.frames import trials_csv
from tuner.results.printers import trial_line, tune_text
from tuner.results.result import TrialResult
from tuner.search import assemble, confirm, explore, front_confirm, lossy, objective, run_guard, study_storage as storage
from tuner.search.budget import format_clock, parse_duration
from tuner.search.setup import TuneSession
from tuner.search.study_storage import Heartbeat, open_storage, redact_url
from tuner.search.trial import run_trial
from tuner.search.prediction import Predictor
from tuner.search.warm_start import enqueue_warm_starts, place_lossy_probes
from tuner.search.options import (  # noqa: F401  (re-exported: callers import them from here)
    Log, TuneOptions, TuneOutcome, stderr_line, default_budget, make_sampler,
)

GiB = 1 << 30

class TuneRun:
    """One tune session's search: the session (setup.py's TuneSession, typed), its Optuna study,
    the cost model's predictor, and what the search adds as it goes (its stall count, stop reason
    and measuring time). finished() is what assemble.build_result reads."""

    def __init__(self, session: TuneSession):
        self.session = session
        self.stall = explore.Stall()
        self.stop_reason = ""  # trials, time budget or converged
        self.measuring_seconds = 0.0  # this session's trial and confirmation runs (the share of wall spent measuring)
        self.predictor: Predictor | None = None
        self.cost_model_state: dict | None = None  # tuner/search/prediction.py: calibrated or not, the warm starts
        self.study: optuna.Study | None = None

    def start(self) -> None:
        s = self.session
        s.start()
        # Every measured trial gets the cost model's figure beside its own (tuner/search/prediction.py).
        self.predictor = Predictor.for_run(s) if s.opts.cost_model else None
        section = getattr(s.profile, "cost_model", None) or {}
        self.cost_model_state = {"calibrated": bool(section.get("factors")), "warm_starts": 0, "note": ""}
        self.study = self.open_study()

    def settings(self) -> dict:
        """What a study is about: a resumed or joined study must match it."""
        s = self.session
        o = s.opts
        return {"model": s.model_name,
                "geometry": {k: s.facts.geometry.get(k) for k in outputs.GEOMETRY_KEYS},
                "budget": s.budget, "objective": o.objective, "space": s.space.describe(),
                "tokens": o.tokens, "repeats": o.repeats, "prompt_tokens": o.prompt_tokens, "cold": o.cold,
                "seed": o.seed, **({"workload": s.work.digest} if s.work.digest else {}),
                # goodput counts against the SLOs: trials judged under others are not comparable
                **({"slo": [o.slo_ttft, o.slo_tpot]} if o.objective == "serve" else {}),
                **({"lossy": dataclasses.asdict(o.lossy)} if o.lossy else {})}

    def open_study(self) -> optuna.Study:
        s = self.session
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        if s.study_name in s.existing:
            # The space must be the one the study was made with (pinned or not).
            recorded = storage.recorded_settings(s.storage, s.study_name)
            if recorded:
                had_pinned = "pinned" in recorded["space"].get("cache_policy", [])
                if had_pinned and not s.space.with_pinned:
                    raise ConfigError(f"study {s.study_name!r} searches cache_policy=pinned but no routing "
                                      f"histogram could be recorded here (calibration: "
                                      f"{s.calibration.get('status')})")
                s.space.with_pinned = had_pinned
                # Read sizes and I/O threads as the study was made with: identical on every worker.
                s.space.chunk_sizes = tuple(recorded["space"].get("chunk_size", s.space.chunk_sizes))
                s.space.io_thread_choices = tuple(recorded["space"].get("io_threads", s.space.io_thread_choices))
                # A fit="plan" knob's choices as the plan fitted them then (the overhead measured now may differ).
                for name in s.space.fitted:
                    if name in recorded["space"]:
                        s.space.fitted[name] = tuple(recorded["space"][name])
        study = optuna.create_study(storage=s.storage, study_name=s.study_name,
                                    directions=objective.DIRECTIONS[s.opts.objective],
                                    sampler=make_sampler(s.opts, s.shared), load_if_exists=True)
        storage.check_settings(study, self.settings())
        storage.fail_unfinished(study, s.shared, s.log)
        enqueue_warm_starts(s, study, self.cost_model_state)
        return study

    # --- search -------------------------------------------------------------------------------

    def complete(self) -> list:
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def measured(self) -> list:
        """COMPLETE trials that evaluated their point (re-proposals left out: explore.py)."""
        return explore.measured(self.complete())

    def counts(self) -> tuple[int, int]:
        """(measured trials, running trials): what --trials counts (re-proposals do not)."""
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
        done = sum(t.state == TrialState.COMPLETE and not explore.is_re_proposal(t.user_attrs) for t in trials)
        return done, sum(t.state == TrialState.RUNNING for t in trials)

    def search(self) -> None:
        s = self.session
        while True:
            interrupts.raise_if_interrupted()  # a Ctrl-C something swallowed (tuner/base/interrupts.py)
            s.watch.check()
            if s.shared:
                optuna.storages.fail_stale_trials(self.study)
            place_lossy_probes(s, self.study)  # tune --max-kl: once the warm starts are measured
            done, running = self.counts()
            if s.opts.trials is not None and done + running >= s.opts.trials:
                self.stop_reason = "trials"
                break
            if not s.clock.room_for_trial():
                s.log(f"time budget: no room for another trial ({format_clock(s.clock.used())} used); "
                      f"confirming")
                self.stop_reason = "time budget"
                break
            trial = self.study.ask()
            try:
                with Heartbeat(s.storage, trial, enabled=s.shared):
                    config = s.space.suggest(trial)
                    earlier = objective.same_point(self.measured(), trial.params)
                    if earlier is not None:
                        self.tell_re_proposal(trial, earlier)
                        if self.stall.re_proposed() and not self.explore_next(trial.number):
                            break
                        continue
                    values, attrs = self.evaluate(trial, config)
            except BaseException:
                # Not measured: FAIL is the honest state (the sampler must not learn from it).
                try:
                    self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                except Exception:
                    pass
                raise
            self.stall.measured()
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            # Optuna 5 samplers read constraints set on the trial (constraints_func is deprecated).
            trial.set_constraint("violation", attrs["constraint"])
            self.study.tell(trial, values)
            self.progress(trial.number, attrs)
            self.write_trials_csv()

    def tell_re_proposal(self, trial: optuna.Trial, earlier) -> None:
        """The sampler proposed a measured point: it is told the earlier figures (a re-run would
        spend a whole trial on one more sample of a known point; the confirmation round
        re-measures anyway), and the trial is marked so nothing counts it as measured."""
        s = self.session
        attrs = {k: v for k, v in earlier.user_attrs.items() if k not in ("role", "worker")}
        attrs.update(role=trial.user_attrs.get("role", "search"), worker=s.worker, duplicate_of=earlier.number)
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        trial.set_constraint("violation", attrs["constraint"])
        self.study.tell(trial, list(earlier.values))
        s.log(f"re-proposal [#{trial.number}] of trial {earlier.number}: not measured, not counted "
              f"({self.stall.in_a_row + 1} in a row) | {s.clock.clock()}")

    def explore_next(self, number: int) -> bool:
        """Enqueue an unmeasured point for the next trial; False: the search has converged."""
        s = self.session
        point, why = explore.exploration_point(self.complete(), s.space.distributions(), s.opts.objective,
                                               s.opts.seed, number)
        if point is None:
            done, _ = self.counts()
            s.log(f"converged after {done} measured trials: the sampler re-proposes measured points and {why}; "
                  f"confirming ({format_clock(s.clock.used())} used)")
            self.stop_reason = "converged"
            return False
        self.study.enqueue_trial(point, user_attrs={"role": "explore"})
        s.log(f"exploring: the sampler re-proposes measured points; next, {why}")
        return True

    def evaluate(self, trial: optuna.Trial, config: EngineConfig) -> tuple[list[float], dict]:
        s = self.session
        role = trial.user_attrs.get("role", "search")
        worst = objective.worst_values(s.opts.objective, s.clock.trial_timeout())
        fits, overshoot, message = s.space.precheck(config)
        if not fits:
            rec = objective.not_launched(role=role, worker=s.worker, config=config.to_dict(),
                                         overshoot=overshoot, budget=s.budget, message=message)
            return worst, rec.to_attrs()
        serve = s.opts.objective == "serve"
        predicted = self.predictor.decode(config) if self.predictor is not None and not serve else None
        predicted_goodput = self.predictor.goodput(config, s.work.trace, s.opts.slo_ttft, s.opts.slo_tpot) \
            if self.predictor is not None and serve else None
        res = self.measure(config)
        setting = lossy.setting_of(config) if s.quality_meter else None
        ref = objective.reference_ids(self.measured(), res.metrics.get("threads"), setting) if res.ok else None
        status, constraint, error = objective.judge(res, s.budget, s.limit_bytes, ref)
        rec = objective.record(res, role=role, worker=s.worker, config=config.to_dict(), status=status,
                               constraint=constraint, error=error)
        attrs = rec.to_attrs()
        if predicted is not None:
            attrs["predicted_decode_tok_s"] = predicted
        if predicted_goodput is not None:
            attrs["predicted_goodput_rps"] = predicted_goodput
        if s.quality_meter and status == "ok":  # the bound is one more constraint, measured per setting
            attrs = lossy.judge_quality(attrs, s.quality_meter.quality(setting), s.opts.lossy)
        if attrs["constraint"] > 0:
            return worst, attrs
        return objective.objective_values(s.opts.objective, res.metrics, s.clock.trial_timeout()), attrs

    def measure(self, config: EngineConfig) -> TrialResult:
        s = self.session
        o = s.opts
        res = run_trial(s.model_dir, config, tokens=o.tokens, repeats=o.repeats, cold=o.cold,
                        prompt_tokens=o.prompt_tokens, seed=o.seed, limit_bytes=s.limit_bytes,
                        timeout=s.clock.trial_timeout(), extra_args=s.work.bench_args)
        if res.status != "timeout":
            s.clock.record(res.wall_seconds)
        self.measuring_seconds += res.wall_seconds
        return res

    def progress(self, number: int, attrs: dict) -> None:
        s = self.session
        done, _ = self.counts()
        total = str(s.opts.trials) if s.opts.trials else f"~{done + s.clock.trials_left()}"
        ranked = self.ranked()
        s.log(trial_line(done, total, number, attrs, s.opts.objective, ranked[0] if ranked else None,
                         s.clock.clock(), explore.search_counts(self.complete()).line()))

    def ranked(self) -> list:
        return confirm.ranked(self.measured(), self.session.opts.objective)

    # --- confirmation and outputs -------------------------------------------------------------

    def confirm(self) -> confirm.Decision:
        s = self.session
        ranked = self.ranked()
        baseline = s.space.baseline()
        baseline_params = s.space.params_of(baseline)
        baseline_trial = self.trial_at(baseline_params)
        defaults = self.defaults()
        entries = confirm.contenders(ranked, s.opts.confirm_top, baseline, baseline_params, baseline_trial,
                                     s.space.config_from_params, defaults)
        if s.opts.confirm_top == 0:
            return confirm.unconfirmed(ranked, entries[-1], baseline_trial, s.space.config_from_params, defaults)
        rounds = confirm.confirm(entries, s.opts.confirm_rounds, self.measure, s.clock.room_for_round, s.log)
        return confirm.decide(entries, rounds, s.opts.objective)

    def defaults(self) -> confirm.Reference:
        s = self.session
        config = s.defaults_config()
        params = s.space.params_of(config)
        return confirm.Reference(config, params, self.trial_at(params))

    def trial_at(self, params: dict):
        """The first measured trial at this point, or None."""
        key = objective.point_key(params)
        return next((t for t in sorted(self.measured(), key=lambda t: t.number)
                     if objective.point_key(t.params) == key), None)

    def finished(self) -> assemble.FinishedSession:
        """The typed record of this session that its result is built from."""
        return assemble.FinishedSession(
            session=self.session, study=self.study, search_counts=explore.search_counts(self.complete()),
            stop_reason=self.stop_reason, measuring_seconds=self.measuring_seconds,
            cost_model_state=self.cost_model_state)

    def write_trials_csv(self) -> None:
        # Through the held directory: a run directory the user deleted is never re-created.
        self.session.watch.write_text("trials.csv", trials_csv(self.study.get_trials(deepcopy=False)))


def run_tune(opts: TuneOptions, log: Log = stderr_line) -> TuneOutcome:
    s = TuneSession.prepare(opts, log)  # every check, nothing written
    run = TuneRun(s)
    with run_guard.hold(s.out, f"tuning {s.study_name}"), interrupts.kept(), s:  # `kill`: as Ctrl-C
        run.start()
        done, _ = run.counts()
        log(f"study {s.study_name!r} in {redact_url(s.storage_url)}: {done} completed trial(s) so far; "
            f"budget {format_size(s.budget)}, objective {opts.objective}, "
            + (f"{opts.trials} trials" if opts.trials else "")
            + (", " if opts.trials and s.clock.seconds else "")
            + (f"time budget {format_clock(s.clock.seconds)}" if s.clock.seconds else ""))
        try:
            run.search()
            decision = run.confirm()
        except optuna.exceptions.StorageInternalError as exc:
            s.watch.check()  # the usual cause: the run directory was deleted under the study
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"study storage {redact_url(s.storage_url)} failed: {first}") from None
        except KeyboardInterrupt:
            if not s.shared:
                # Ctrl-C can land between `study.ask()` and the guarded measurement, or while a
                # finished trial is being told: no trial of this run may stay RUNNING. (A shared
                # storage is left to the heartbeats: other workers' trials are RUNNING there.)
                storage.fail_unfinished(run.study, False, s.log, when="interrupted")
            done, _ = run.counts()
            run.write_trials_csv()
            again = (f"colibri tune --resume --model {opts.model} --out {s.out} --study-name {s.study_name}"
                     + (f" --storage {redact_url(s.storage_url)}" if opts.storage else ""))
            log(f"interrupted: {done} completed trial(s) are saved in {redact_url(s.storage_url)}; "
                f"continue with: {again}")
            raise
        tune = assemble.build_result(run.finished(), decision)
        result = tune.to_dict()
        s.watch.check()
        files = outputs.write_outputs(s.out, run.study, s.profile, tune, s.log)
        if opts.lossy is not None:
            trials = run.complete()
            summary = lossy.front_summary(trials, opts.lossy, result.get("recommended"), s.facts.quant)
            # The search figures favour the setting searched most (best of many noisy trials):
            # the front rounds re-measure its points alike before it is drawn.
            try:
                summary = front_confirm.confirm_front(summary, trials, opts.front_rounds, run.measure,
                                                      s.clock.room_for_round, log)
            except KeyboardInterrupt:  # the rest is written: lossy.json keeps the search figures
                lossy.write_summary(s.out, summary)
                log("interrupted in the front rounds: lossy.json holds the search figures only")
                raise
            files.update(lossy.write_summary(s.out, summary))
            for line in lossy.markdown(summary).splitlines()[4:]:
                log(line)
    if tune.recommended is None:
        raise BudgetError(f"no configuration ran within the budget {format_size(s.budget)} "
                          f"({tune.study.by_status}); see {s.out / 'trials.csv'}")
    return TuneOutcome(out_dir=s.out, tune=tune, recommended_path=files.get("recommended.toml"), files=files)


def format_outcome(outcome: TuneOutcome) -> str:
    return tune_text(outcome.tune, outcome.files)


__all__ = ["TuneOptions", "TuneOutcome", "run_tune", "format_outcome", "parse_duration", "default_budget",
           "open_storage", "redact_url"]
