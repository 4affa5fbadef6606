"""The points a new or joined study measures first, enqueued before the sampler proposes any.

The rules-of-thumb baseline, then with --from-profile the best config a profile records for this
geometry, then the engine's defaults (the point the headline gain is measured against, and a
good start), then the cost model's top predicted configs. `session` is the tune session
(tuner/search/setup.py's TuneSession).

With a quality bound, the lossy probes (one step along each lossy dimension) come after those:
their settings are fixed when the study is made, their placement once every lossless warm start
has been measured, at the fastest of them (place_lossy_probes), so the speed–quality front
compares settings at one good placement rather than a probe's placement with the search's best.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import optuna
from optuna.trial import TrialState

from engine.api import ConfigError, EngineConfig, format_size
from tuner.costmodel.best_config import study_warm_starts
from tuner.search.prediction import run_conditions, trusted
from tuner.search import confirm, explore, lossy

if TYPE_CHECKING:
    from tuner.search.setup import TuneSession

# Study attributes (in the storage, so every worker of a shared study reads the same ones):
PROBES_ATTR = "lossy_probes"  # the probe settings, fixed when the study is made
PLACED_ATTR = "lossy_probes_at"  # the trial whose placement they were enqueued at (None: the baseline's)
# The warm starts whose placement the probes may take: enqueued before any probe, so the set is
# the same on every worker, and all of it is measured before the probes are placed.
WARM_ROLES = ("baseline", "from_profile", "defaults", "model")
SERVE_NO_WARM_START = ("--objective serve: the goodput prediction is uncalibrated (calibration holds out one "
                       "stream's decode, not a trace's goodput), so it seeds nothing")


def enqueue_warm_starts(session: TuneSession, study: optuna.Study, state: dict) -> None:
    """`state`: the run's cost_model_state, told how many predicted configs were enqueued and why not more."""
    fresh = not study.trials
    o = session.opts
    study.enqueue_trial(session.space.params_of(session.space.baseline()), user_attrs={"role": "baseline"},
                        skip_if_exists=True)
    queued = 1
    if session.warm_entry:
        try:
            config = EngineConfig.from_dict(session.warm_entry["config"], source="--from-profile config")
        except ConfigError as exc:
            session.log(f"--from-profile: skipped an unusable recorded config ({exc})")
        else:
            study.enqueue_trial(session.space.params_of(config), user_attrs={"role": "from_profile"},
                                skip_if_exists=True)
            queued += 1
    # A queued trial the trial budget never runs would sit in the study as WAITING.
    if o.trials is None or o.trials > queued:
        study.enqueue_trial(session.space.params_of(session.defaults_config()), user_attrs={"role": "defaults"},
                            skip_if_exists=True)
        queued += 1
    if session.space.lossy and fresh:
        queued += reserve_lossy_probes(session, study, queued)
    if o.cost_model and session.facts.has_experts and fresh:
        enqueue_predicted(session, study, queued, state)


def reserve_lossy_probes(session: TuneSession, study: optuna.Study, queued: int) -> int:
    """tune --max-kl: each lossy dimension once, so its price in speed and quality is measured even
    when the sampler would not go there in a short run. Only the settings are fixed here (and
    counted against --trials); place_lossy_probes enqueues them once the warm starts are measured."""
    probes = lossy.probes(session.space.lossy)
    if session.opts.trials is not None:
        probes = probes[:max(0, session.opts.trials - queued - 1)]  # leave the sampler at least one
    if probes:
        study.set_user_attr(PROBES_ATTR, probes)
    return len(probes)


def probe_placement(trials, objective: str):
    """The fastest feasible lossless warm start (ties: the lowest trial number), or None while a
    warm start is still waiting or running (None too when none is feasible: `ready` says which)."""
    warm = sorted((t for t in trials if t.user_attrs.get("role") in WARM_ROLES), key=lambda t: t.number)
    if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in warm):
        return None, False
    done = [t for t in explore.measured(warm) if t.state == TrialState.COMPLETE
            and lossy.is_lossless({k: t.params.get(k, v) for k, v in lossy.LOSSLESS.items()})]
    best = confirm.ranked(done, objective)  # a stable sort: equal figures keep trial order
    return (best[0] if best else None), True


def place_lossy_probes(session: TuneSession, study: optuna.Study) -> None:
    """Enqueue the reserved probes at the best lossless placement the warm starts measured.

    Deterministic for a shared study: the candidates are the warm starts only (a fixed set, all
    finished before any worker places), and the first worker to place records it in the study,
    so the others skip; two placing at once enqueue the same points (skip_if_exists keeps one)."""
    probes = study.user_attrs.get(PROBES_ATTR)
    if not probes or PLACED_ATTR in study.user_attrs:
        return
    best, ready = probe_placement(study.get_trials(deepcopy=False), session.opts.objective)
    if not ready:
        return
    params = dict(best.params) if best is not None else session.space.params_of(session.space.baseline())
    study.set_user_attr(PLACED_ATTR, best.number if best is not None else None)
    for setting in probes:
        study.enqueue_trial({**params, **setting}, skip_if_exists=True,
                            user_attrs={"role": "lossy_probe", "placement_of": best.number if best else None})
    where = f"trial {best.number}'s placement ({best.user_attrs.get('role')})" if best is not None else \
        "the baseline's placement (no lossless warm start was feasible)"
    session.log(f"lossy probes: {', '.join(lossy.label({**lossy.LOSSLESS, **p}) for p in probes)} at {where}")


def enqueue_predicted(session: TuneSession, study: optuna.Study, queued: int, state: dict) -> None:
    """The cost model's top predicted configs, measured right after the baseline and the defaults,
    of the kinds of config (io mode, cache policy) whose calibrated error is known and small
    (tuner/search/prediction.py): a prediction no trial has checked is not worth a trial."""
    o = session.opts
    if getattr(o, "objective", None) == "serve":
        # The gate trusts a prediction whose held-out error calibration measured; calibration measures
        # one stream's decode, never a trace's goodput, so no predicted config has earned a trial here.
        state["note"] = SERVE_NO_WARM_START
        session.log(f"cost model: no warm start: {SERVE_NO_WARM_START}")
        return
    # Never more than the trial budget leaves after the points queued before.
    n = 3 if o.trials is None else max(0, min(3, o.trials - queued))
    if not n:
        return
    section = getattr(session.profile, "cost_model", None) or {}
    if not section.get("factors"):
        state["note"] = trusted(section, session.space.baseline())[1]
        session.log(f"cost model: no warm start: {state['note']}")
        return
    skipped: list[str] = []
    enqueued = 0
    # More candidates than needed: the gate may turn the first ones away.
    for r in study_warm_starts(session.space, session.profile, session.model_dir, run_conditions(session), 4 * n):
        ok, why = trusted(section, r.config)
        if not ok:
            if why not in skipped:
                skipped.append(why)
            continue
        study.enqueue_trial(session.space.params_of(r.config), skip_if_exists=True,
                            user_attrs={"role": "model", "predicted_decode_tok_s": r.prediction.decode_tok_s})
        session.log(f"cost model: warm start {r.config.io_mode}, chunk {format_size(r.config.chunk_size)}, "
                f"prefetch {r.config.prefetch_depth}, cache ratio {r.config.cpu_cache_ratio}, "
                f"{r.config.cache_policy}: predicted {r.prediction.decode_tok_s:.3g} tok/s")
        enqueued += 1
        if enqueued >= n:
            break
    state["warm_starts"] = enqueued
    state["note"] = "; ".join(f"skipped: {w}" for w in skipped)
    for why in skipped:
        session.log(f"cost model: warm start skipped: {why}")
