"""The `colibri` command line: argument parsing only, over importable library functions.

Every subcommand is `add_<name>(subparsers)` + `cmd_<name>(args) -> int`. Errors that are the
input's fault (`engine.errors.ColibriError`) become one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import CACHE_POLICIES, COMPUTE_DTYPES, IO_MODES, KV_DTYPES
from engine.errors import ColibriError
from tuner.printers import print_json as _print_json


# --- run ------------------------------------------------------------------------------------

def _add_engine_flags(p) -> None:
    """Flags shared by run and bench: each overrides the same key of --config."""
    p.add_argument("--config", help="engine config TOML (e.g. a tune run's recommended.toml)")
    p.add_argument("--ram-budget", help="memory budget, e.g. 1GiB (0 = everything resident)")
    p.add_argument("--ctx-size", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--chunk-size", help="read request size, e.g. 1MiB")
    p.add_argument("--prefetch-depth", type=int)
    p.add_argument("--cpu-cache-ratio", type=float)
    p.add_argument("--gpu-cache-ratio", type=float)
    p.add_argument("--io-mode", choices=IO_MODES)
    p.add_argument("--io-threads", type=int)
    p.add_argument("--cache-policy", choices=CACHE_POLICIES)
    p.add_argument("--kv-dtype", choices=KV_DTYPES)
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, help="compute dtype (auto: the checkpoint's)")
    p.add_argument("--routing-histogram", help="routing histogram JSON for cache_policy=pinned")


def engine_config_from_args(args):
    from engine.config import EngineConfig, parse_size
    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    overrides = {
        "ram_budget": parse_size(args.ram_budget) if args.ram_budget is not None else None,
        "chunk_size": parse_size(args.chunk_size) if args.chunk_size is not None else None,
        "ctx_size": args.ctx_size, "threads": args.threads, "prefetch_depth": args.prefetch_depth,
        "cpu_cache_ratio": args.cpu_cache_ratio, "gpu_cache_ratio": args.gpu_cache_ratio,
        "io_mode": args.io_mode, "io_threads": args.io_threads, "cache_policy": args.cache_policy,
        "kv_dtype": args.kv_dtype, "dtype": args.dtype, "routing_histogram": args.routing_histogram,
    }
    return config.replace(**overrides)


def add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with the streaming engine")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name (e.g. demo)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    prompt.add_argument("--prompt-tokens", type=int, help="N token ids drawn deterministically from --seed")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed for --prompt-tokens and sampling")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--record-routing", metavar="FILE", help="write the routing histogram (for cache_policy=pinned)")
    _add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (with prompt and output ids)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from engine.generate import Sampler
    from engine.resolve import resolve_model
    from engine.session import run_generation
    from tuner.printers import run_header, run_text

    config = engine_config_from_args(args)
    model_dir = resolve_model(args.model, progress=not args.json)
    result = run_generation(model_dir, config, prompt=args.prompt, prompt_ids=args.prompt_ids,
                            prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                            sampler=Sampler(args.temperature, args.top_p, args.seed),
                            record_routing=args.record_routing)
    if args.json:
        _print_json(result)
        return 0
    if "text" in result:
        print(result["text"])
    else:
        print("output ids:", ",".join(map(str, result["output_ids"])))
    print(run_header(result), file=sys.stderr)
    print(run_text(result), file=sys.stderr)
    return 0


# --- bench ----------------------------------------------------------------------------------

def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure decode speed: warm-up, then N tokens K times (median, spread)")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name")
    p.add_argument("--tokens", type=int, default=16, help="decode tokens per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    temp = p.add_mutually_exclusive_group()
    temp.add_argument("--cold", dest="cold", action="store_true", default=True,
                      help="drop the model's pages and the expert caches before each repeat (default)")
    temp.add_argument("--warm", dest="cold", action="store_false", help="keep caches across repeats")
    p.add_argument("--cgroup-limit", help="run inside a child memory cgroup limited to SIZE (page cache counts)")
    p.add_argument("--timeout", type=float, default=None, help="seconds, with --cgroup-limit")
    p.add_argument("--record-routing", metavar="FILE", help="write the routing histogram (for cache_policy=pinned)")
    _add_engine_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from engine.config import parse_size
    from engine.resolve import resolve_model

    config = engine_config_from_args(args)
    model_dir = resolve_model(args.model, progress=not args.json)
    if args.cgroup_limit:
        from tuner.trial import run_trial
        extra = ["--record-routing", args.record_routing] if args.record_routing else []
        trial = run_trial(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=args.cold,
                          prompt_tokens=args.prompt_tokens, seed=args.seed,
                          limit_bytes=parse_size(args.cgroup_limit), timeout=args.timeout, extra_args=extra)
        if not trial.ok:
            if args.json:
                _print_json(trial.to_dict())
            print(f"colibri bench: error: trial {trial.status}: {trial.error}", file=sys.stderr)
            return 1
        result = trial.metrics
    else:
        from engine.bench import run_bench

        def progress(i, n, m):
            if not args.json:
                print(f"  repeat {i}/{n}: decode {m.get('decode_tok_s') or 0:.2f} tok/s", file=sys.stderr)

        result = run_bench(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=args.cold,
                           prompt_tokens=args.prompt_tokens, seed=args.seed, progress=progress,
                           record_routing=args.record_routing)
    if args.json:
        _print_json(result)
    else:
        from tuner.printers import bench_text
        print(bench_text(result))
    return 0


# --- probe ----------------------------------------------------------------------------------

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
    from engine.progress import Progress
    from tuner.probe import format_summary, run_probe, save_profile

    with Progress(desc="probe", unit="step") as bar:
        profile = run_probe(args.dir, quick=args.quick, use_fio=False if args.no_fio else None,
                            progress=bar.step, fio_path=args.fio)
    if args.output:
        save_profile(profile, args.output)
        print(f"profile written to {args.output}", file=sys.stderr)
    if args.json:
        _print_json(profile.to_dict())
    else:
        print(format_summary(profile))
    return 0


# --- tune -----------------------------------------------------------------------------------

def add_tune(sub) -> None:
    from tuner.objective import OBJECTIVES, SAMPLERS
    p = sub.add_parser("tune", help="search the engine settings for this machine and model (Optuna)")
    p.add_argument("--model", default="demo", help="model directory or synth preset (default: demo)")
    p.add_argument("--ram-budget", help="memory budget, e.g. 1GiB (default: 1GiB for demo, else 88%% of available)")
    limit = p.add_argument_group("how long")
    limit.add_argument("--time-budget", help="wall time for the whole run, e.g. 10m (default 15m without --trials)")
    limit.add_argument("--trials", type=int, help="completed trials in the study (resumed ones count)")
    p.add_argument("--min-ctx", type=int, default=2048, help="smallest context size to consider (default 2048)")
    p.add_argument("--objective", choices=OBJECTIVES, default="decode")
    p.add_argument("--out", help="run directory (default: reports/tune-<model>-<time>; with --resume, the latest)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite file in the run directory); "
                                     "postgresql://... lets several machines share one study")
    p.add_argument("--study-name", help="default: <model>-<budget>-<objective>")
    p.add_argument("--resume", action="store_true", help="continue the study in --out / --storage")
    p.add_argument("--from-profile", metavar="FILE", help="warm start from the best config a profile records "
                                                          "for this model geometry")
    p.add_argument("--profile", metavar="FILE", help="reuse a saved probe instead of probing")
    p.add_argument("--seed", type=int, default=0, help="sampler and prompt seed")
    t = p.add_argument_group("trial measurement")
    t.add_argument("--tokens", type=int, default=8, help="decode tokens per repeat (default 8)")
    t.add_argument("--repeats", type=int, default=2, help="repeats per trial; the figure is their median (default 2)")
    t.add_argument("--prompt-tokens", type=int, default=8, help="prompt length (default 8)")
    t.add_argument("--warm", dest="cold", action="store_false", default=True,
                   help="keep caches across repeats (default: cold, weights from disk)")
    t.add_argument("--trial-timeout", type=float, help="seconds per trial (default: 5x a measured trial, >= 60)")
    t.add_argument("--cgroup-limit", help="trial memory cgroup limit (default: the budget)")
    t.add_argument("--confirm-top", type=int, default=3, help="candidates re-measured against the baseline "
                                                              "(0: no confirmation round)")
    t.add_argument("--confirm-rounds", type=int, default=2, help="most confirmation rounds (time permitting)")
    t.add_argument("--no-cost-model", dest="cost_model", action="store_false",
                   help="search the full read-size / I/O-thread ranges and enqueue no predicted configs")
    t.add_argument("--sampler", choices=SAMPLERS, default="auto",
                   help="auto (default): GP for one objective, TPE for --objective both")
    p.add_argument("--json", action="store_true", help="print result.json")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from engine.config import parse_size
    from tuner.study import TuneOptions, format_outcome, parse_duration, run_tune

    opts = TuneOptions(
        model=args.model, ram_budget=parse_size(args.ram_budget) if args.ram_budget else None,
        time_budget=parse_duration(args.time_budget) if args.time_budget else None, trials=args.trials,
        min_ctx=args.min_ctx, objective=args.objective, out=args.out, storage=args.storage,
        study_name=args.study_name, resume=args.resume, from_profile=args.from_profile, profile=args.profile,
        seed=args.seed, tokens=args.tokens, repeats=args.repeats, prompt_tokens=args.prompt_tokens, cold=args.cold,
        trial_timeout=args.trial_timeout, cgroup_limit=parse_size(args.cgroup_limit) if args.cgroup_limit else None,
        confirm_top=args.confirm_top, confirm_rounds=args.confirm_rounds, sampler=args.sampler,
        cost_model=args.cost_model)
    outcome = run_tune(opts)
    if args.json:
        _print_json(outcome.result)
    else:
        print(format_outcome(outcome))
    return 0


# --- synth ----------------------------------------------------------------------------------

def add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic MoE model (HF qwen3_moe directory) from a preset or geometry")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("preset", nargs="?", help="preset name (tiny, demo; real-model specs are geometry-only)")
    src.add_argument("--geometry", metavar="FILE", help="geometry JSON with the same keys as a preset")
    src.add_argument("--list", action="store_true", help="list the presets and their sizes")
    p.add_argument("-o", "--out", metavar="DIR", help="output directory (written atomically)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    p.add_argument("--routing-skew", type=float, default=None, metavar="X",
                   help="0 = near-uniform routing; default: the preset's calibrated value (see docs/SYNTH.md)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args) -> int:
    import time
    from engine import synth
    from engine.errors import ConfigError

    from tuner.printers import presets_text, synth_text

    if args.list:
        rows = synth.describe_presets()
        if args.json:
            _print_json(rows)
        else:
            print(presets_text(rows))
        return 0
    if not args.out:
        raise ConfigError("missing -o/--out DIR")
    geometry = synth.load_geometry_file(args.geometry) if args.geometry else synth.load_preset(args.preset)
    t0 = time.perf_counter()
    out = synth.synthesize(geometry, args.out, seed=args.seed, routing_skew=args.routing_skew,
                           progress=not args.json, force=args.force)
    summary = {**synth.summarize(out), "seconds": round(time.perf_counter() - t0, 2)}
    if args.json:
        _print_json(summary)
    else:
        print(synth_text(summary))
    return 0


def add_plan(sub) -> None:
    from tuner.costmodel.command import add_plan_arguments
    p = sub.add_parser("plan", help="predict the memory plan, speed and bottleneck of a model on a profile; "
                                    "calibrate the prediction on a tune run")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from tuner.costmodel.command import format_plan, run_plan
    result = run_plan(args)
    if args.json:
        _print_json(result)
    else:
        print(format_plan(result))
    return 0


# --- report, profile, compare --------------------------------------------------------------

def add_report(sub) -> None:
    p = sub.add_parser("report", help="(re)write a tune run's report.md and self-contained report.html")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `colibri tune` run directory")
    p.add_argument("--storage", help="the study's storage URL when it is not the run's study.db (PostgreSQL)")
    p.add_argument("--open", action="store_true", help="open report.html in the default browser")
    p.add_argument("--json", action="store_true", help="print the written files as JSON")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from tuner.report_html import write_reports
    files = write_reports(args.run_dir, storage=args.storage)
    if args.json:
        _print_json({k: str(v) for k, v in files.items()})
    else:
        print(f"report.md: {files['report.md']}\nreport.html: {files['report.html']}")
    if args.open:
        import webbrowser
        if not webbrowser.open(files["report.html"].resolve().as_uri()):
            print(f"colibri report: no browser to open; the page is {files['report.html']}", file=sys.stderr)
    return 0


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="shareable hardware profiles: export, import, list, show, diff")
    ps = p.add_subparsers(dest="action", metavar="ACTION")
    ps.required = True
    e = ps.add_parser("export", help="a run directory or probe JSON → a shareable profile (no identity)")
    e.add_argument("source", metavar="RUN_DIR|PROBE_JSON")
    e.add_argument("-o", "--output", metavar="FILE", help="write here (default: print it)")
    e.add_argument("--include-identity", action="store_true",
                   help="keep the hostname, user name and model paths (for your own records)")
    i = ps.add_parser("import", help="validate a profile and copy it into the local store")
    i.add_argument("file", metavar="FILE")
    i.add_argument("--name", help="store name (default: <cpu>-<disk>-<fingerprint>)")
    i.add_argument("--force", action="store_true", help="replace a different profile of the same name")
    ps.add_parser("list", help="the profiles in the local store")
    s = ps.add_parser("show", help="one profile: hardware and best configs")
    s.add_argument("ref", metavar="NAME|FILE")
    d = ps.add_parser("diff", help="two profiles: hardware differences, best configs side by side")
    d.add_argument("a", metavar="A")
    d.add_argument("b", metavar="B")
    for q in (e, i, s, d, ps.choices["list"]):
        q.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    from engine.config import format_size
    from tuner import profiles
    if args.action == "export":
        data = profiles.export_profile(args.source, include_identity=args.include_identity)
        if args.output:
            profiles.write_profile_file(data, args.output)
            print(f"profile written to {args.output} ({len(data['best_configs'])} best config(s)"
                  + (", WITH identity" if args.include_identity else "") + ")", file=sys.stderr)
        if args.json or not args.output:
            _print_json(data)
    elif args.action == "import":
        name, path, changed = profiles.import_profile(args.file, name=args.name, force=args.force)
        if args.json:
            _print_json({"name": name, "path": str(path), "changed": changed})
        else:
            print(f"{'imported' if changed else 'already in the store:'} {name} ({path})")
    elif args.action == "list":
        rows = profiles.list_profiles()
        if args.json:
            _print_json(rows)
        elif not rows:
            print(f"no profiles in {profiles.store_dir()} (colibri profile import FILE)")
        for r in [] if args.json else rows:
            print(f"{r['name']}: invalid ({r['error']})" if "error" in r else
                  f"{r['name']:<44} {r['cpu'][:32]:<32} {r['cores']:>3} cores {format_size(r['ram_bytes']):>9} "
                  f"{r['disk']:<16} {r['configs']} config(s)  {r['created_utc']}")
    elif args.action == "show":
        label, data = profiles.resolve(args.ref)
        if args.json:
            _print_json(data)
        else:
            print(profiles.format_show(label, data))
    else:
        d = profiles.diff(profiles.resolve(args.a), profiles.resolve(args.b))
        if args.json:
            _print_json(d)
        else:
            print(profiles.format_diff(d))
    return 0


def add_compare(sub) -> None:
    p = sub.add_parser("compare", help="tune runs and/or profiles side by side (markdown, HTML, plots)")
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR|PROFILE", help="run directories, profile files or "
                                                                         "names in the local store")
    p.add_argument("--out", metavar="DIR", help="where to write (default: reports/compare-<time>)")
    p.add_argument("--force", action="store_true", help="compare even when the conditions differ "
                                                        "(model, budget, cold/warm, tokens, tool version)")
    p.add_argument("--model", metavar="NAME|HASH", help="from profiles, only the entries of this model "
                                                        "(name, or geometry hash prefix)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    from tuner.compare import compare, format_text
    summary = compare(args.inputs, out_dir=args.out, force=args.force, model=args.model)
    if args.json:
        _print_json(summary)
    else:
        print(format_text(summary))
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


def _quant_adders():
    from tuner.quant_commands import add_convert, add_quality
    return [add_convert, add_quality]


ADDERS = [add_run, add_bench, add_probe, add_tune, add_synth, add_plan, add_report, add_profile, add_compare,
          *_quant_adders()]


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
    except BrokenPipeError:  # `colibri ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
