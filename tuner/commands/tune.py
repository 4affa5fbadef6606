"""`colibri tune`: argument parsing over tuner.study.run_tune."""

from __future__ import annotations

from engine.base.errors import ConfigError
from tuner.results.printers import print_json as _print_json


def add_tune(sub) -> None:
    from tuner.search.objective import OBJECTIVES, SAMPLERS
    p = sub.add_parser("tune", help="search the engine settings for this machine and model (Optuna)")
    p.add_argument("--model", default="demo", help="model directory or synth preset (default: demo)")
    p.add_argument("--ram-budget", help="memory budget, e.g. 1GiB (default: 1GiB for demo, else 88%% of available)")
    limit = p.add_argument_group("how long")
    limit.add_argument("--time-budget", help="wall time for the whole run, e.g. 10m (default 15m without --trials)")
    limit.add_argument("--trials", type=int, help="completed trials in the study (resumed ones count)")
    p.add_argument("--min-ctx", type=int, default=2048, help="smallest context size to consider (default 2048)")
    p.add_argument("--objective", choices=OBJECTIVES, default="decode")
    p.add_argument("--out", help="run directory (default: reports/tune-<model>-<time>; with --resume, the latest)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite file in the run directory); "
                                     "postgresql://... lets several machines share one study")
    p.add_argument("--study-name", help="default: <model>-<budget>-<objective>")
    p.add_argument("--resume", action="store_true", help="continue the study in --out / --storage")
    p.add_argument("--from-profile", metavar="FILE", help="warm start from the best config a profile records "
                                                          "for this model geometry")
    p.add_argument("--profile", metavar="FILE", help="reuse a saved probe instead of probing")
    p.add_argument("--seed", type=int, default=0, help="sampler and prompt seed")
    t = p.add_argument_group("trial measurement")
    t.add_argument("--tokens", type=int, default=8, help="decode tokens per repeat (default 8)")
    t.add_argument("--repeats", type=int, default=2, help="repeats per trial; the figure is their median (default 2)")
    t.add_argument("--prompt-tokens", type=int, default=8, help="prompt length (default 8)")
    t.add_argument("--warm", dest="cold", action="store_false", default=True,
                   help="keep caches across repeats (default: cold, weights from disk)")
    t.add_argument("--trial-timeout", type=float, help="seconds per trial (default: 5x a measured trial, >= 60)")
    t.add_argument("--cgroup-limit", help="trial memory cgroup limit (default: the budget)")
    t.add_argument("--confirm-top", type=int, default=3, help="candidates re-measured against the baseline "
                                                              "(0: no confirmation round)")
    t.add_argument("--confirm-rounds", type=int, default=2, help="most confirmation rounds (time permitting)")
    t.add_argument("--no-cost-model", dest="cost_model", action="store_false",
                   help="search the full read-size / I/O-thread ranges and enqueue no predicted configs")
    t.add_argument("--sampler", choices=SAMPLERS, default="auto",
                   help="auto (default): GP for one objective, TPE for --objective both")
    q = p.add_argument_group("quant levels (one study per level, then a comparison)")
    q.add_argument("--quant", metavar="LEVELS",
                   help="e.g. bf16,int8,int4: the source as stored (bf16/fp16/fp32), int8, int4 or int4-g32/64/128 "
                        "(int4 = g64); each quantized level is converted once into the model cache and scored "
                        "against the source; --trials and --time-budget apply to each level")
    q.add_argument("--quality-tokens", type=int, default=2048, help="tokens of text scored per level (default 2048)")
    q.add_argument("--quality-ctx", type=int, default=512, help="quality chunk length (default 512)")
    q.add_argument("--quality-text", metavar="FILE", help="text to score (default: held-out Python stdlib sources)")
    q.add_argument("--prepare-only", action="store_true",
                   help="convert the levels and score their quality, then stop (tune later with --resume)")
    p.add_argument("--json", action="store_true", help="print result.json (with --quant: the levels' summary)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from engine.base.config import parse_size
    from tuner.search.study import TuneOptions, format_outcome, parse_duration, run_tune

    opts = TuneOptions(
        model=args.model, ram_budget=parse_size(args.ram_budget) if args.ram_budget else None,
        time_budget=parse_duration(args.time_budget) if args.time_budget else None, trials=args.trials,
        min_ctx=args.min_ctx, objective=args.objective, out=args.out, storage=args.storage,
        study_name=args.study_name, resume=args.resume, from_profile=args.from_profile, profile=args.profile,
        seed=args.seed, tokens=args.tokens, repeats=args.repeats, prompt_tokens=args.prompt_tokens, cold=args.cold,
        trial_timeout=args.trial_timeout, cgroup_limit=parse_size(args.cgroup_limit) if args.cgroup_limit else None,
        confirm_top=args.confirm_top, confirm_rounds=args.confirm_rounds, sampler=args.sampler,
        cost_model=args.cost_model)
    if args.quant is not None:
        return _tune_quant(args, opts)
    if args.prepare_only:
        raise ConfigError("--prepare-only goes with --quant")
    outcome = run_tune(opts)
    if args.json:
        _print_json(outcome.result)
    else:
        print(format_outcome(outcome))
    return 0


def _tune_quant(args, opts) -> int:
    from tuner.search.quant_tune import QuantTuneOptions, format_quant_outcome, parse_levels, run_quant_tune
    outcome = run_quant_tune(QuantTuneOptions(
        opts, parse_levels(args.quant), quality_tokens=args.quality_tokens, quality_ctx=args.quality_ctx,
        quality_text=args.quality_text, prepare_only=args.prepare_only))
    if args.json:
        _print_json(outcome.summary)
    else:
        print(format_quant_outcome(outcome))
    return 0
