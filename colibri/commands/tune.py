"""`colibri tune`: argument parsing over tuner.search.study.run_tune (the flags: TuneOptions' fields)."""

from __future__ import annotations

from engine.api import CTX_MAX, ConfigError, check_regular
from colibri.commands.argtypes import finite_float, int_in, positive_int
from colibri.commands.knob_flags import add_knob_flags, knob_values
from colibri.commands.run import TOKENS_MAX
from tuner.results.printers import print_json as _print_json
from tuner.search.lossy import QualityBound
from tuner.search.options import TuneOptions
from tuner.search.quant_tune import QuantTuneOptions, format_quant_outcome, parse_levels, run_quant_tune
from tuner.search.study import format_outcome, run_tune


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="search the engine settings for this machine and model (Optuna)")
    # TuneOptions' fields are the flags (tuner/search/options.py): kind, range, help and group.
    groups = {name: p.add_argument_group(name) for name in ("how long", "trial measurement")}
    add_knob_flags(p, TuneOptions, groups)
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
    if args.quality_text is not None:  # refused before anything starts (a FIFO, /dev/zero, too big)
        check_regular(args.quality_text, "text corpus", ConfigError)

    # sizes in bytes and durations in seconds already (colibri/commands/argtypes.py)
    opts = TuneOptions(**knob_values(args, TuneOptions), lossy=_quality_bound(args))
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
    if args.max_kl is None and args.min_top1 is None:
        return None
    return QualityBound(max_kl=args.max_kl, min_top1=args.min_top1, tokens=args.quality_tokens,
                        ctx=args.quality_ctx, text=args.quality_text).validate()


def _tune_quant(args, opts) -> int:
    outcome = run_quant_tune(QuantTuneOptions(
        opts, parse_levels(args.quant), quality_tokens=args.quality_tokens, quality_ctx=args.quality_ctx,
        quality_text=args.quality_text, prepare_only=args.prepare_only))
    if args.json:
        _print_json(outcome.summary)
    else:
        print(format_quant_outcome(outcome))
    return 0
