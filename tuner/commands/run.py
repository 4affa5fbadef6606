"""`colibri run` and `colibri bench`: the engine flags they share, and the two commands."""

from __future__ import annotations

import sys

from engine.base.config import CACHE_POLICIES, COMPUTE_DTYPES, IO_BACKENDS, IO_MODES, KV_DTYPES
from tuner.results.printers import print_json as _print_json


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
    p.add_argument("--io-backend", choices=IO_BACKENDS, help="what issues the reads: reader threads or io_uring")
    p.add_argument("--cache-policy", choices=CACHE_POLICIES)
    p.add_argument("--kv-dtype", choices=KV_DTYPES)
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, help="compute dtype (auto: the checkpoint's)")
    p.add_argument("--routing-histogram", help="routing histogram JSON for cache_policy=pinned")


def engine_config_from_args(args):
    from engine.base.config import EngineConfig, parse_size
    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    overrides = {
        "ram_budget": parse_size(args.ram_budget) if args.ram_budget is not None else None,
        "chunk_size": parse_size(args.chunk_size) if args.chunk_size is not None else None,
        "ctx_size": args.ctx_size, "threads": args.threads, "prefetch_depth": args.prefetch_depth,
        "cpu_cache_ratio": args.cpu_cache_ratio, "gpu_cache_ratio": args.gpu_cache_ratio,
        "io_mode": args.io_mode, "io_threads": args.io_threads,
        "io_backend": args.io_backend, "cache_policy": args.cache_policy,
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
    from engine.run.generate import Sampler
    from engine.run.resolve import resolve_model
    from engine.run.oneshot import run_generation
    from tuner.results.printers import run_header, run_text

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
    p.add_argument("--read-trace", metavar="FILE", help="write every decode read (file, offset, bytes, submit and "
                                                        "completion time, token, layer) as JSON lines, for "
                                                        "benchmarks/trace_bound.py's fio replay")
    p.add_argument("--outcome", metavar="FILE", help="write how the run ended as a JSON record (the tuner's "
                                                     "trials read it: ok with the results, or the error's kind)")
    _add_engine_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def _check_writable(path: str) -> None:
    """Refuse an output path up front, not after the whole run (one line, exit 2)."""
    import os
    from pathlib import Path

    from engine.base.errors import ConfigError
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"--read-trace {path}: is a directory")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--read-trace {path}: directory {parent} does not exist or is not writable")


def cmd_bench(args) -> int:
    from engine.base.config import parse_size
    from engine.run.resolve import resolve_model

    config = engine_config_from_args(args)
    if args.read_trace:
        _check_writable(args.read_trace)
    model_dir = resolve_model(args.model, progress=not args.json)
    if args.cgroup_limit:
        from tuner.search.trial import run_trial
        extra = ["--record-routing", args.record_routing] if args.record_routing else []
        extra += ["--read-trace", args.read_trace] if args.read_trace else []
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
        from engine.run.bench import run_bench

        def progress(i, n, m):
            if not args.json:
                print(f"  repeat {i}/{n}: decode {m.get('decode_tok_s') or 0:.2f} tok/s", file=sys.stderr)

        result = run_bench(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=args.cold,
                           prompt_tokens=args.prompt_tokens, seed=args.seed, progress=progress,
                           record_routing=args.record_routing, read_trace=args.read_trace)
    if args.outcome:
        from tuner.search.outcome import Outcome, write_outcome
        write_outcome(args.outcome, Outcome("ok", metrics=result))
    if args.json:
        _print_json(result)
    else:
        from tuner.results.printers import bench_text
        print(bench_text(result))
    return 0
