"""`colibri probe` (measure this machine) and `colibri plan` (predict a model on a profile)."""

from __future__ import annotations

import sys

from engine.api import CTX_MAX, ConfigError, Progress, file_target
from colibri.commands.argtypes import add_output_option, finite_float, int_list, nonneg_int, positive_int, size
from tuner.costmodel.model_geometry import QUANTS
from tuner.costmodel.plan_command import PlanRequest, run_plan
from tuner.probe import format_summary, run_probe, save_profile
from tuner.results.plan_printers import plan_text
from tuner.results.printers import print_json as _print_json
from tuner.share.profiles import PROFILE_FILE


def add_probe(sub) -> None:
    p = sub.add_parser("probe", help="measure this machine's disk, memory and CPU")
    # A new, uniquely named test file (O_EXCL) is made there and removed: nothing there is replaced.
    add_output_option(p, "--dir", kind="scratch", default=".",
                      help="directory whose disk is measured (a test file is written there and "
                           "removed); default: the current directory")
    p.add_argument("--quick", action="store_true", help="fewer points, shorter jobs")
    p.add_argument("--no-fio", action="store_true",
                   help="use the Python O_DIRECT fallback even when fio is installed")
    p.add_argument("--fio", default=None, help="fio binary (default: $COLIBRI_FIO, else PATH)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    add_output_option(p, "-o", "--output", kind="file", metavar="FILE", default=None,
                      help="also write the profile JSON here")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    # Before the probe runs: its directory must exist and take files (file_target probes it).
    output = file_target(args.output, command="probe", recognise=PROFILE_FILE) if args.output is not None else None
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


def add_plan_arguments(p) -> None:
    p.add_argument("--model", required=True, help="model directory, bundled geometry (e.g. glm-5) or geometry JSON")
    # Read, and with --calibrate rewritten with the fitted factors (a profile replaced by a profile).
    add_output_option(p, "--profile", kind="file", required=True,
                      help="hardware profile JSON (colibri probe / tune); --calibrate writes its factors into it")
    p.add_argument("--quant", choices=QUANTS, help="quant level (default: the model's own dtype)")
    p.add_argument("--config", help="engine config TOML to predict (default: the engine's defaults)")
    p.add_argument("--budget", type=size(), help="memory budget, e.g. 24GiB (default: the config's, else 88%% of the "
                                    "profile's available memory)")
    p.add_argument("--what-if", action="append", default=[], metavar="KEY=VALUE",
                   help="edit a measured figure: disk_bw=7GB/s, disk_scale=2, memory_bw=100GB/s, ram=64GiB, "
                        "cores=16, matmul_scale=2 (repeatable)")
    p.add_argument("--routing", default="auto",
                   help="uniform, skew[:X] (synth's routing skew), or a routing histogram JSON (default: the "
                        "model's synth skew, else skew:1 — real models are far from uniform)")
    p.add_argument("--conditions", choices=("steady", "trial"), default="steady",
                   help="steady: long generation, warm cache (default); trial: the tuner's cold 8-token trial")
    p.add_argument("--top", type=positive_int(1000), default=3, help="best predicted configs to list")
    p.add_argument("--prompt-tokens", type=positive_int(CTX_MAX), metavar="N",
                   help="also predict the time to first token of a prompt of N new tokens, cold (reads, compute)")
    p.add_argument("--cached-tokens", type=nonneg_int(CTX_MAX), default=0, metavar="M",
                   help="with --prompt-tokens: after M tokens whose KV the prefix cache reuses (restored from RAM, "
                        "or the SSD where the config's prefix_cache cannot hold them)")
    p.add_argument("--batch", type=int_list(1, 256), default=(),
                   help="batch sizes to predict, e.g. 1,2,4,8: several sequences decoding together (serve's "
                        "max_batch): per-sequence and aggregate tok/s, bytes per step, where the bound moves")
    p.add_argument("--calibrate", metavar="RUN_DIR", nargs="+",
                   help="fit the factors to the trials of tune run directories (or tuner_quality grid.json files), "
                        "print the cross-validated error, store the factors in --profile")
    p.add_argument("--test", metavar="RUN_DIR", help="with --calibrate: also predict this run's trials with the "
                                                      "factors fitted on the others (a fully separate hold-out)")
    p.add_argument("--accept-rate", type=finite_float(0.0, 1.0, name="acceptance"), default=None,
                   help="also predict speculative decoding at this draft acceptance (0..1): the speed-up or loss "
                        "per depth up to the config's draft_depth, and what the gate would choose")
    p.add_argument("--drafter", choices=("lookup", "mtp"), default="lookup",
                   help="with --accept-rate: who drafts (mtp costs one decoder layer per drafted token)")
    p.add_argument("--json", action="store_true")


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict the memory plan, speed and bottleneck of a model on a profile; "
                                    "calibrate the prediction on a tune run")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)


def plan_request(args) -> PlanRequest:
    """The typed request of `colibri plan`'s flags (each PlanRequest field is the flag of its name)."""
    given = {name: getattr(args, name) for name in PlanRequest.field_names()}
    return PlanRequest(**{**given, "what_if": tuple(given["what_if"] or ()), "calibrate": tuple(given["calibrate"] or ()),
                          "batch": tuple(given["batch"] or ())})


def cmd_plan(args) -> int:
    if args.cached_tokens and not args.prompt_tokens:
        raise ConfigError("--cached-tokens goes with --prompt-tokens (the new tokens after them)")
    if args.calibrate:  # it will be rewritten: only ever a profile, never a FIFO, device or another file
        args.profile = str(file_target(args.profile, command="probe", recognise=PROFILE_FILE, flag="--profile"))
    result = run_plan(plan_request(args))
    if args.json:
        _print_json(result.to_dict())
    else:
        print(plan_text(result))
    return 0
