"""The `colibri` command line: one parser over the per-command modules in colibri/commands/.

Every subcommand is `add_<name>(subparsers)` + `cmd_<name>(args) -> int` in its module, a thin
layer of argument parsing over importable library functions. Errors that are the input's fault
(`engine.base.errors.ColibriError`) become one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import sys

from engine.api import ColibriError, end_open_line, printable
from colibri.commands.argtypes import ColibriArgumentParser
from tuner.search.outcome import outcome_of_exception, write_outcome

# Every subcommand, in `colibri --help` order: its name → the module that declares it (add_<name>).
# The modules are imported by name, and for `colibri <command>` only that command's: each one
# pulls in its own libraries (the server, Optuna and SQLAlchemy, the report's plots, pandas), and
# a process that runs one command need not pay for the others. That matters most for
# `colibri bench`, which a tune starts once per trial (tuner/search/trial.py): ~0.5 s of CPU
# less per trial process on this project's 2-vCPU box (docs/BENCHMARKS.md, cispeed).
COMMANDS = {"run": "colibri.commands.run", "bench": "colibri.commands.run", "probe": "colibri.commands.machine",
            "tune": "colibri.commands.tune", "synth": "colibri.commands.synth", "plan": "colibri.commands.machine",
            "report": "colibri.commands.results", "profile": "colibri.commands.results",
            "compare": "colibri.commands.results", "convert": "colibri.commands.convert",
            "quality": "colibri.commands.convert", "serve": "colibri.commands.serve", "chat": "colibri.commands.serve",
            "doctor": "colibri.commands.doctor"}


def build_parser(only: str | None = None) -> ColibriArgumentParser:
    """The parser of every command, or of `only` (one of COMMANDS) alone."""
    parser = ColibriArgumentParser(
        prog="colibri",
        description="Tune a streaming MoE engine for this machine: probe, run, bench, tune.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMANDS.items():
        if only is None or name == only:
            getattr(importlib.import_module(module), f"add_{name}")(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A known command first: only its parser. Anything else (--help, a typo, nothing) gets the
    # whole parser, so the listing and the "invalid choice" line name every command.
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a refused argument (one line already printed) or --help: return its code
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except BaseException as exc:
        # A trial process: the tuner reads how it ended from here. Only a path that passed the
        # output guard (colibri/commands/run.check_output_files): a refused --outcome (the model's
        # config.json, /dev/full) must not be written by its own refusal.
        if getattr(args, "outcome_target", None):
            write_outcome(args.outcome_target, outcome_of_exception(exc))
        end_open_line(sys.stderr)  # a progress line left open (convert, quality): the message starts its own
        if isinstance(exc, ColibriError):
            # printable: a message quotes names from files (models, profiles, tensors); their
            # control characters are escaped so they cannot drive the terminal.
            print(f"colibri {args.command}: error: {printable(str(exc), limit=4000)}", file=sys.stderr)
            return exc.exit_code
        if isinstance(exc, KeyboardInterrupt):
            print(f"colibri {args.command}: interrupted", file=sys.stderr)
            return 130
        if isinstance(exc, BrokenPipeError):  # `colibri ... | head`: the reader left; not an error of ours
            sys.stderr.close()
            return 0
        raise


if __name__ == "__main__":
    sys.exit(main())
