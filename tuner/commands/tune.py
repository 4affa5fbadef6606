"""`colibri tune`: argument parsing over tuner.study.run_tune."""

from __future__ import annotations

from engine.base.errors import ConfigError
from tuner.commands.argtypes import SEED_MAX, duration, finite_float, int_in, nonneg_int, positive_int, seconds, size
from tuner.commands.run import CTX_MAX, TOKENS_MAX
from tuner.results.printers import print_json as _print_json
from engine.base.inputs import check_regular


def add_tune(sub) -> None:
    from tuner.search.objective import OBJECTIVES, SAMPLERS
    p = sub.add_parser("tune", help="search the engine settings for this machine and model (Optuna)")
    p.add_argument("--model", default="demo", help="model directory or synth preset (default: demo)")
    p.add_argument("--ram-budget", type=size(), help="memory budget, e.g. 1GiB (default: 1GiB for demo, else 88%% of available)")
    limit = p.add_argument_group("how long")
    limit.add_argument("--time-budget", type=duration(), help="wall time for the whole run, e.g. 10m (default 15m without --trials)")
    limit.add_argument("--trials", type=positive_int(100_000), help="measured trials in the study (resumed ones count; a re-proposal of a measured point does not)")
    p.add_argument("--min-ctx", type=int_in(1, CTX_MAX), default=2048, help="smallest context size to consider (default 2048)")
    p.add_argument("--objective", choices=OBJECTIVES, default="decode")
    p.add_argument("--out", help="run directory (default: reports/tune-<model>-<time>; with --resume, the latest)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite file in the run directory); "
                                     "postgresql://... lets several machines share one study")
    p.add_argument("--study-name", help="default: <model>-<budget>-<objective>")
    p.add_argument("--resume", action="store_true", help="continue the study in --out / --storage")
    p.add_argument("--from-profile", metavar="FILE", help="warm start from the best config a profile records "
                                                          "for this model geometry")
    p.add_argument("--profile", metavar="FILE", help="reuse a saved probe instead of probing")
    # The calibration trial runs `bench --seed SEED+1`: the top seed is left for it.
    p.add_argument("--seed", type=int_in(0, SEED_MAX - 1, "seed"), default=0, help="sampler and prompt seed")
    t = p.add_argument_group("trial measurement")
    t.add_argument("--tokens", type=positive_int(TOKENS_MAX), default=8, help="decode tokens per repeat (default 8)")
    t.add_argument("--repeats", type=positive_int(1000), default=2, help="repeats per trial; the figure is their median (default 2)")
    t.add_argument("--prompt-tokens", type=positive_int(TOKENS_MAX), default=8, help="prompt length (default 8)")
    t.add_argument("--prompts", metavar="FILE",
                   help="your workload: one prompt per line, or JSON Lines of {prompt, max_new_tokens} (default "
                        "max_new_tokens: --tokens); each trial runs them all, the pinned policy's routing is "
                        "recorded from them, and --objective request ranks by their end-to-end latency")
    t.add_argument("--warm", dest="cold", action="store_false", default=True,
                   help="keep caches across repeats (default: cold, weights from disk)")
    t.add_argument("--trial-timeout", type=seconds(), help="seconds per trial (default: 5x a measured trial, >= 60)")
    t.add_argument("--cgroup-limit", type=size(), help="trial memory cgroup limit (default: the budget)")
    t.add_argument("--confirm-top", type=nonneg_int(100), default=3, help="candidates re-measured against the baseline "
                                                              "(0: no confirmation round)")
    t.add_argument("--confirm-rounds", type=positive_int(100), default=2, help="most confirmation rounds (time permitting)")
    t.add_argument("--no-cost-model", dest="cost_model", action="store_false",
                   help="search the full read-size / I/O-thread ranges and enqueue no predicted configs")
    t.add_argument("--sampler", choices=SAMPLERS, default="auto",
                   help="auto (default): GP for one objective, TPE for --objective both")
    q = p.add_argument_group("quant levels (one study per level, then a comparison)")
    q.add_argument("--quant", metavar="LEVELS",
                   help="e.g. bf16,int8,int4: the source as stored (bf16/fp16/fp32), int8, int4 or int4-g32/64/128 "
                        "(int4 = g64), and int8-all / int4-g64-all with the dense part quantized too; each quantized "
                        "level is converted once into the model cache and scored "
                        "against the source; --trials and --time-budget apply to each level")
    q.add_argument("--quality-tokens", type=positive_int(TOKENS_MAX), default=2048, help="tokens of text scored per level (default 2048)")
    q.add_argument("--quality-ctx", type=int_in(4, CTX_MAX), default=512, help="quality chunk length (default 512)")
    q.add_argument("--quality-text", metavar="FILE", help="text to score (default: held-out Python stdlib sources)")
    q.add_argument("--prepare-only", action="store_true",
                   help="convert the levels and score their quality, then stop (tune later with --resume)")
    lossy = p.add_argument_group("lossy settings under a quality bound (off: the search never changes tokens)")
    lossy.add_argument("--max-kl", type=finite_float(0.0, 100.0, lo_open=True), metavar="NATS",
                       help="search KV precision, top-k reduction and an expert threshold too (with --quant: the "
                            "levels too), keeping configs whose mean KL to the lossless model is at most this, "
                            "measured on --quality-tokens of --quality-text; e.g. 0.01")
    lossy.add_argument("--min-top1", type=finite_float(0.0, 1.0, lo_open=True), metavar="SHARE",
                       help="as --max-kl, for the share of positions whose top-1 token agrees; e.g. 0.98")
    p.add_argument("--json", action="store_true", help="print result.json (with --quant: the levels' summary)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from tuner.search.study import TuneOptions, format_outcome, run_tune

    if args.quality_text is not None:  # refused before anything starts (a FIFO, /dev/zero, too big)
        check_regular(args.quality_text, "text corpus", ConfigError)

    opts = TuneOptions(  # sizes in bytes and durations in seconds already (tuner/commands/argtypes.py)
        model=args.model, ram_budget=args.ram_budget, time_budget=args.time_budget, trials=args.trials,
        min_ctx=args.min_ctx, objective=args.objective, out=args.out, storage=args.storage,
        study_name=args.study_name, resume=args.resume, from_profile=args.from_profile, profile=args.profile,
        seed=args.seed, tokens=args.tokens, repeats=args.repeats, prompt_tokens=args.prompt_tokens,
        prompts=args.prompts, cold=args.cold,
        trial_timeout=args.trial_timeout, cgroup_limit=args.cgroup_limit,
        confirm_top=args.confirm_top, confirm_rounds=args.confirm_rounds, sampler=args.sampler,
        cost_model=args.cost_model, lossy=_quality_bound(args))
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


def _quality_bound(args):
    from tuner.search.lossy import QualityBound
    if args.max_kl is None and args.min_top1 is None:
        return None
    return QualityBound(max_kl=args.max_kl, min_top1=args.min_top1, tokens=args.quality_tokens,
                        ctx=args.quality_ctx, text=args.quality_text).validate()


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
