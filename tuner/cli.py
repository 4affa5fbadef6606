"""The `colibri` command line: one parser over the per-command modules in tuner/commands/.

Every subcommand is `add_<name>(subparsers)` + `cmd_<name>(args) -> int` in its module, a thin
layer of argument parsing over importable library functions. Errors that are the input's fault
(`engine.errors.ColibriError`) become one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import sys

from engine.base.errors import ColibriError
from engine.base.inputs import printable
from tuner.commands.argtypes import ColibriArgumentParser
from tuner.commands.doctor import add_doctor
from tuner.commands.machine import add_plan, add_probe
from tuner.commands.quant import add_convert, add_quality
from tuner.commands.results import add_compare, add_profile, add_report
from tuner.commands.run import add_bench, add_run
from tuner.commands.serve import add_chat, add_serve
from tuner.commands.synth import add_synth
from tuner.commands.tune import add_tune
from tuner.search.outcome import outcome_of_exception, write_outcome

ADDERS = [add_run, add_bench, add_probe, add_tune, add_synth, add_plan, add_report, add_profile, add_compare,
          add_convert, add_quality, add_serve, add_chat, add_doctor]


def build_parser() -> ColibriArgumentParser:
    parser = ColibriArgumentParser(
        prog="colibri",
        description="Tune a streaming MoE engine for this machine: probe, run, bench, tune.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in ADDERS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a refused argument (one line already printed) or --help: return its code
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except BaseException as exc:
        if getattr(args, "outcome", None):  # a trial process: the tuner reads how it ended from here
            write_outcome(args.outcome, outcome_of_exception(exc))
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
