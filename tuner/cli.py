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
    p.add_argument("--io-mode", choices=["direct", "buffered", "mmap"])
    p.add_argument("--io-threads", type=int)
    p.add_argument("--cache-policy", choices=["lru", "lfu", "pinned"])
    p.add_argument("--kv-dtype", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], help="compute dtype (auto: the checkpoint's)")
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
    _add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (with prompt and output ids)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    from engine.generate import Sampler
    from engine.metrics import human_summary
    from engine.models import resolve_model
    from engine.session import run_generation

    config = engine_config_from_args(args)
    model_dir = resolve_model(args.model, progress=not args.json)
    result = run_generation(model_dir, config, prompt=args.prompt, prompt_ids=args.prompt_ids,
                            prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                            sampler=Sampler(args.temperature, args.top_p, args.seed))
    if args.json:
        _print_json(result)
        return 0
    if "text" in result:
        print(result["text"])
    else:
        print("output ids:", ",".join(map(str, result["output_ids"])))
    plan = result["plan"]
    mode = f"streaming ({result['config']['io_mode']})" if plan["streaming"] else "resident"
    print(f"[{mode}, {result['compute_dtype']}, {result['threads']} threads, prompt {result['prompt_tokens']} "
          f"tokens, {result['generated_tokens']} generated]", file=sys.stderr)
    print(human_summary(result), file=sys.stderr)
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
    except BrokenPipeError:  # `colibri ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
