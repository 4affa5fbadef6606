"""`colibri convert` and `colibri quality`: argument parsing over engine/format/convert.py and engine/run/quality.py (through engine.api)."""

from __future__ import annotations

import time
from pathlib import Path

from engine.api import QUANTS, convert, format_quality, import_and_convert, is_gguf, measure_quality, resolve_model
from colibri.commands.argtypes import add_output_option, int_in, nonneg_int, positive_int
from colibri.commands.run import CTX_MAX, TOKENS_MAX
from tuner.results.printers import convert_progress
from tuner.results.printers import print_json as _print_json
from tuner.results.printers import quality_progress


def add_convert(sub) -> None:
    p = sub.add_parser("convert", help="write an int8 / int4 quantized container of a model (docs/FORMAT.md)")
    p.add_argument("src", help="source model directory, a synth preset name, or a GGUF file (single, or any "
                               "part of a split -0000N-of-0000M.gguf): imported to bf16, then --quant if given")
    add_output_option(p, "-o", "--out", kind="directory", required=True, metavar="DST",
                      help="output directory (written atomically)")
    p.add_argument("--quant", choices=QUANTS, default=None,
                   help="default int4 for a model directory; none for a GGUF (the bf16 import only)")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64, help="int4 group size (default 64)")
    p.add_argument("--scope", choices=["experts", "all"], default="experts",
                   help="experts (default): routed experts only; all: every linear weight but embeddings/routers")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument("--threads", type=positive_int(1024), default=1,
                   help="torch threads (default 1: the per-matrix work is small, and on a shared box extra "
                        "threads spin more than they compute)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    import torch
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if is_gguf(Path(args.src)):
        return _convert_gguf(args, t0)
    src = resolve_model(args.src, progress=not args.json)
    summary = convert(src, args.out, args.quant or "int4", args.group_size, args.scope, force=args.force,
                      progress=convert_progress(not args.json))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        _print_json(summary)
    else:
        print(f"wrote {summary['path']}: {summary['label']} ({summary['scope']}), {summary['bytes'] / 2**20:.1f} MiB "
              f"from {summary['source_bytes'] / 2**20:.1f} MiB, {summary['shards']} shard(s) "
              f"({summary['shards_kept']} kept from an interrupted run), {summary['seconds']:.1f} s")
    return 0


def _convert_gguf(args, t0: float) -> int:
    summary = import_and_convert(args.src, args.out, args.quant, args.group_size, args.scope, force=args.force,
                                 progress=convert_progress(not args.json))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        _print_json(summary)
        return 0
    imported = summary.get("imported", summary)
    what = f"{summary['label']} ({summary['scope']})" if args.quant else "bf16"
    print(f"wrote {summary['path']}: {imported['model_type']} {what} from GGUF {imported['source']['file']} "
          f"({', '.join(f'{k} x{v}' for k, v in imported['source']['types'].items())}), "
          f"{summary['bytes'] / 2**20:.1f} MiB, {summary['shards']} shard(s), {summary['seconds']:.1f} s")
    print(f"  tokenizer: {imported['tokenizer']}")
    if imported["skipped"]:
        print(f"  skipped {len(imported['skipped'])} tensor(s): {'; '.join(imported['skipped'][:4])}"
              f"{' ...' if len(imported['skipped']) > 4 else ''}")
    return 0


def add_quality(sub) -> None:
    p = sub.add_parser("quality", help="KL divergence, top-1 agreement and perplexity of a model against a reference")
    p.add_argument("--model", required=True, help="the model under test (e.g. a quantized container)")
    p.add_argument("--reference", required=True, help="the reference model (e.g. the bf16 source)")
    p.add_argument("--tokens", type=positive_int(TOKENS_MAX), default=4096, help="length of the token stream (default 4096)")
    p.add_argument("--ctx", type=int_in(4, CTX_MAX), default=512, help="chunk length; the second half of each is scored")
    p.add_argument("--text", help="UTF-8 text file to score (default: held-out Python stdlib sources)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="compute dtype of both models")
    p.add_argument("--threads", type=nonneg_int(1024), default=0, help="torch threads (0 = physical cores)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_quality)


def cmd_quality(args) -> int:
    r = measure_quality(args.model, args.reference, tokens=args.tokens, ctx=args.ctx, text_file=args.text,
                        dtype=args.dtype, threads=args.threads,
                        progress=quality_progress(not args.json))
    if args.json:
        _print_json(r)
    else:
        print(format_quality(r))
    return 0
