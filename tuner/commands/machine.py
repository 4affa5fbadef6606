"""`colibri probe` (measure this machine) and `colibri plan` (predict a model on a profile)."""

from __future__ import annotations

import sys

from engine.base.output_target import file_target
from tuner.results.printers import print_json as _print_json
from tuner.share.profiles import PROFILE_FILE
from tuner.commands.argtypes import check_output_file


def add_probe(sub) -> None:
    p = sub.add_parser("probe", help="measure this machine's disk, memory and CPU")
    p.add_argument("--dir", default=".",
                   help="directory whose disk is measured (a test file is written there and "
                        "removed); default: the current directory")
    p.add_argument("--quick", action="store_true", help="fewer points, shorter jobs")
    p.add_argument("--no-fio", action="store_true",
                   help="use the Python O_DIRECT fallback even when fio is installed")
    p.add_argument("--fio", default=None, help="fio binary (default: $COLIBRI_FIO, else PATH)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("-o", "--output", default=None, help="also write the profile JSON here")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    from engine.base.progress import Progress
    from tuner.probe import format_summary, run_probe, save_profile

    output = file_target(args.output, command="probe", recognise=PROFILE_FILE) if args.output is not None else None
    if output is not None:
        check_output_file(str(output), "-o")  # its directory must exist and take files, before the probe runs
    with Progress(desc="probe", unit="step") as bar:
        profile = run_probe(args.dir, quick=args.quick, use_fio=False if args.no_fio else None,
                            progress=bar.step, fio_path=args.fio)
    if output:
        save_profile(profile, output)
        print(f"profile written to {args.output}", file=sys.stderr)
    if args.json:
        _print_json(profile.to_dict())
    else:
        print(format_summary(profile))
    return 0


def add_plan(sub) -> None:
    from tuner.costmodel.plan_command import add_plan_arguments
    p = sub.add_parser("plan", help="predict the memory plan, speed and bottleneck of a model on a profile; "
                                    "calibrate the prediction on a tune run")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from tuner.costmodel.plan_command import format_plan, run_plan
    result = run_plan(args)
    if args.json:
        _print_json(result)
    else:
        print(format_plan(result))
    return 0
