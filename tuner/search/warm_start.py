"""The points a new or joined study measures first, enqueued before the sampler proposes any.

The rules-of-thumb baseline, then with --from-profile the best config a profile records for this
geometry, then the engine's defaults (the point the headline gain is measured against, and a
good start), then the cost model's top predicted configs. `run` is tuner.search.study._Run.
"""

from __future__ import annotations

import optuna

from engine.base.config import EngineConfig, format_size
from engine.base.errors import ConfigError
from tuner.costmodel.predict import RunConditions
from tuner.costmodel.search import study_warm_starts
from tuner.search import lossy


def enqueue_warm_starts(run, study: optuna.Study) -> None:
    fresh = not study.trials
    o = run.opts
    study.enqueue_trial(run.space.params_of(run.space.baseline()), user_attrs={"role": "baseline"},
                        skip_if_exists=True)
    queued = 1
    if run.warm_entry:
        try:
            config = EngineConfig.from_dict(run.warm_entry["config"], source="--from-profile config")
        except ConfigError as exc:
            run.log(f"--from-profile: skipped an unusable recorded config ({exc})")
        else:
            study.enqueue_trial(run.space.params_of(config), user_attrs={"role": "from_profile"},
                                skip_if_exists=True)
            queued += 1
    # A queued trial the trial budget never runs would sit in the study as WAITING.
    if o.trials is None or o.trials > queued:
        study.enqueue_trial(run.space.params_of(run.defaults_config()), user_attrs={"role": "defaults"},
                            skip_if_exists=True)
        queued += 1
    if run.space.lossy and fresh:
        queued += enqueue_lossy_probes(run, study, queued)
    if o.cost_model and run.facts.has_experts and fresh:
        enqueue_predicted(run, study, queued)


def enqueue_lossy_probes(run, study: optuna.Study, queued: int) -> int:
    """tune --max-kl: each lossy dimension once at the baseline's placement, so its price in speed
    and quality is measured even when the sampler would not go there in a short run."""
    probes = lossy.probes(run.space.lossy)
    if run.opts.trials is not None:
        probes = probes[:max(0, run.opts.trials - queued - 1)]  # leave the sampler at least one
    base = run.space.params_of(run.space.baseline())
    for setting in probes:
        study.enqueue_trial({**base, **setting}, user_attrs={"role": "lossy_probe"}, skip_if_exists=True)
    return len(probes)


def enqueue_predicted(run, study: optuna.Study, queued: int) -> None:
    """The cost model's top predicted configs, measured right after the baseline and the defaults."""
    o = run.opts
    # Never more than the trial budget leaves after the points queued before.
    n = 3 if o.trials is None else max(0, min(3, o.trials - queued))
    if not n:
        return
    # The trials' own lengths: with --prompts, a typical request of the user's workload.
    w = run.workload_info
    cond = RunConditions(prompt_tokens=max(1, round(w.prompt_tokens.median)),
                         tokens=max(1, round(w.max_new_tokens.median)), repeats=o.repeats, cold=o.cold)
    for r in study_warm_starts(run.space, run.profile, run.model_dir, cond, n):
        study.enqueue_trial(run.space.params_of(r.config), skip_if_exists=True,
                            user_attrs={"role": "model", "predicted_decode_tok_s": r.prediction.decode_tok_s})
        run.log(f"cost model: warm start {r.config.io_mode}, chunk {format_size(r.config.chunk_size)}, "
                f"prefetch {r.config.prefetch_depth}, cache ratio {r.config.cpu_cache_ratio}, "
                f"{r.config.cache_policy}: predicted {r.prediction.decode_tok_s:.3g} tok/s")
