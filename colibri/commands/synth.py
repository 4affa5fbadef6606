"""`colibri synth`: write a synthetic MoE model from a preset or a geometry."""

from __future__ import annotations

from engine.api import ConfigError, synth
from colibri.commands.argtypes import add_output_option, finite_float, seed
from tuner.results.printers import print_json as _print_json
from tuner.results.printers import presets_text, synth_text


def add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic MoE model (HF qwen3_moe directory) from a preset or geometry")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("preset", nargs="?", help="preset name (tiny, demo; real-model specs are geometry-only)")
    src.add_argument("--geometry", metavar="FILE", help="geometry JSON with the same keys as a preset")
    src.add_argument("--list", action="store_true", help="list the presets and their sizes")
    add_output_option(p, "-o", "--out", kind="directory", metavar="DIR", help="output directory (written atomically)")
    p.add_argument("--seed", type=seed(), default=0, help="same seed, same bytes (default 0)")
    p.add_argument("--routing-skew", type=finite_float(0.0), default=None, metavar="X",
                   help="0 = near-uniform routing; default: the preset's calibrated value (see docs/SYNTH.md)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args) -> int:
    import time

    if args.list:
        rows = synth.describe_presets()
        if args.json:
            _print_json(rows)
        else:
            print(presets_text(rows))
        return 0
    if args.out is None:  # -o "" is refused by the output rules, naming it (it would mean the current directory)
        raise ConfigError("missing -o/--out DIR")
    geometry = synth.load_geometry_file(args.geometry) if args.geometry else synth.load_preset(args.preset)
    t0 = time.perf_counter()
    out = synth.synthesize(geometry, args.out, seed=args.seed, routing_skew=args.routing_skew,
                           progress=not args.json, force=args.force,
                           sources=(args.geometry,) if args.geometry else ())
    summary = {**synth.summarize(out), "seconds": round(time.perf_counter() - t0, 2)}
    if args.json:
        _print_json(summary)
    else:
        print(synth_text(summary))
    return 0
