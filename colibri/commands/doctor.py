"""`colibri doctor`: a preflight over the machine, the model's files, a probe and the budget."""

from __future__ import annotations

from pathlib import Path

from engine.api import EngineConfig, Progress, kv_root, parse_size, resolve_model
from tuner.doctor.facts import gather
from tuner.doctor.rules import diagnose
from colibri.commands.argtypes import int_in, size
from colibri.commands.run import CTX_MAX
from colibri.commands.serve import KV_DISK_DEFAULT, default_prefix_cache
from tuner.probe import run_probe
from tuner.probe.hardware_profile import load_profile
from tuner.results.printers import print_json

MARKS = {"ok": "ok  ", "warn": "WARN", "problem": "FAIL"}


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check the machine, the model and the budget before streaming; say what to fix")
    p.add_argument("--model", help="model directory, or a synth preset name (its files, its memory plan)")
    p.add_argument("--ram-budget", type=size(), default=None, help="the budget to check the plan against (e.g. 1GiB)")
    p.add_argument("--ctx-size", type=int_in(1, CTX_MAX), default=None)
    p.add_argument("--conversation-tokens", type=int_in(1, CTX_MAX), default=None, metavar="N",
                   help="check a conversation of N tokens: the KV cache at that context, its copy in the prefix "
                        "cache, and what the SSD tier (--kv-disk) gives")
    p.add_argument("--prefix-cache", type=size(zero_ok=True, zero_means="off"), default=None,
                   help="the prefix cache's RAM for --conversation-tokens (default: serve's, 256MiB or an eighth of "
                        "--ram-budget when less)")
    p.add_argument("--kv-disk", type=size(zero_ok=True, zero_means="KV in RAM only"), default=KV_DISK_DEFAULT,
                   help="the SSD tier's bound for --conversation-tokens (default: serve's, 8GiB)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a saved probe (colibri probe -o P.json) for the SSD rules")
    src.add_argument("--probe", action="store_true", help="run a quick probe on the model's disk for the SSD rules")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    config = EngineConfig()
    if args.ram_budget is not None:
        config = config.replace(ram_budget=parse_size(args.ram_budget))
    if args.ctx_size is not None:
        config = config.replace(ctx_size=args.ctx_size)
    model_dir = Path(resolve_model(args.model, progress=not args.json)) if args.model else None
    profile = load_profile(args.profile) if args.profile else None
    if args.probe:
        with Progress(desc="probe", unit="step", enabled=not args.json) as bar:
            profile = run_probe(model_dir or ".", quick=True, progress=bar.step)
    conversation = None
    if args.conversation_tokens is not None:  # as serve would run it: its prefix cache and SSD tier
        prefix = default_prefix_cache(config.ram_budget) if args.prefix_cache is None else args.prefix_cache
        conversation = (config.replace(prefix_cache=prefix), args.conversation_tokens, args.kv_disk, kv_root())
    diagnosis = diagnose(gather(model_dir, config if args.ram_budget is not None else None, profile, conversation))
    if args.json:
        print_json(diagnosis.to_dict())
    else:
        for f in diagnosis.findings:
            print(f"{MARKS[f.severity]}  {f.rule:15} {f.symptom}")
            if f.severity != "ok":
                print(f"      {'':15} cause: {f.cause}")
                print(f"      {'':15} fix:   {f.fix}")
        if profile is None:
            print(f"      {'ssd':15} not checked: pass --profile P.json or --probe")
        print(f"verdict: {diagnosis.verdict()}")
    return 1 if diagnosis.problems else 0
