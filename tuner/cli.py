"""The `colibri` command line: argument parsing only, over importable library functions.

Every subcommand is `add_<name>(subparsers)` + `cmd_<name>(args) -> int`. Errors that are the
input's fault (`engine.errors.ColibriError`) become one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.errors import ColibriError


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


# --- run ------------------------------------------------------------------------------------

def add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with the streaming engine")
    p.add_argument("--model", required=True, help="model directory (or a synth preset name)")
    cmd = p.add_mutually_exclusive_group()
    cmd.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    cmd.add_argument("--prompt-ids", help="comma-separated token ids")
    cmd.add_argument("--prompt-tokens", type=int, help="N token ids drawn deterministically from --seed")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--ctx-size", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="compute dtype (default: the checkpoint's, bf16 for bf16 weights)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from engine.generate import run_cli  # heavy import (torch) only when needed
    result = run_cli(args)
    if args.json:
        _print_json(result)
    return 0


# --- main -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Tune a streaming MoE engine for this machine: probe, run, bench, tune.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in ADDERS:
        add(sub)
    return parser


ADDERS = [add_run]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ColibriError as exc:
        print(f"colibri {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"colibri {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
