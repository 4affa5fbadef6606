"""`colibri run` and `colibri bench`: the engine flags they share, and the two commands."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from engine.api import (CTX_MAX, STEADY_TEMPERATURE, STEADY_TOP_P, TRACE_FORMAT, BenchResult, ConfigError,
                        EngineConfig, PromptError, Sampler, bench, file_target, is_kv_file, json_file_with,
                        json_lines_head_with, load_requests, load_tokenizer, load_workload, read_trace, resolve_model,
                        run)
from colibri.commands.argtypes import add_output_option, finite_float, nonneg_int, positive_int, seconds, seed, size
from colibri.commands.knob_flags import knob_flag
from tuner.results.printers import print_json as _print_json
from tuner.results.printers import bench_text, run_header, run_text
from tuner.search.outcome import OUTCOME_FILE, Outcome, write_outcome
from tuner.search.trial import run_trial, steady_args, trace_args

TOKENS_MAX = CTX_MAX  # prompt and new tokens must fit in a context
SLO_MAX_S = 86400.0  # a latency bound of more than a day bounds nothing

ROUTING_FILE = json_file_with("schema", "counts")  # a routing histogram written before (engine/movement/cache)
TRACE_FILE = json_lines_head_with(format=TRACE_FORMAT)  # a read trace written before (engine/movement/io/trace.py)

# The files run/bench write at the end, each with what a previous one of its kind looks like.
OUTPUT_FILES = {"outcome": ("--outcome", OUTCOME_FILE), "record_routing": ("--record-routing", ROUTING_FILE),
                "read_trace": ("--read-trace", TRACE_FILE), "prompt_cache": ("--prompt-cache", is_kv_file)}


def model_sources(args) -> list[str]:
    """The model as given, when it is a path (a preset name is resolved later, into the cache)."""
    return [args.model] if args.model and os.path.lexists(args.model) else []


def check_output_files(args, command: str) -> None:
    """Every output file the command was given, checked before anything runs (engine/base/
    output_target.file_target: not '', '.', '/', the model or inside it, a directory, a FIFO, a
    device, or an existing file that is not a previous output of its kind). Each value becomes the
    resolved path; the CLI records a failed trial's outcome only in a path that passed
    (`args.outcome_target`), so a refused --outcome is never written either."""
    for dest, (flag, recognise) in OUTPUT_FILES.items():
        raw = getattr(args, dest, None)
        if raw is not None:
            setattr(args, dest, str(file_target(raw, command=command, recognise=recognise, flag=flag,
                                                sources=model_sources(args))))
            if dest == "outcome":
                args.outcome_target = args.outcome


def add_engine_flags(p) -> None:
    """Flags shared by run, bench, serve and chat, one per EngineConfig field (engine/base/config.py:
    the field's metadata is the flag); each overrides the same key of --config."""
    p.add_argument("--config", help="engine config TOML (e.g. a tune run's recommended.toml)")
    lossy = p.add_argument_group("lossy settings (off by default; each changes the output)")
    # Each flag's range is its field's metadata (tests/test_argtypes.py checks that it agrees with
    # EngineConfig.validate), so a bad flag is refused while parsing, before the model is opened.
    # No default: a flag not given leaves --config's value.
    for f in dataclasses.fields(EngineConfig):
        flag, kw = knob_flag(f, with_default=False)
        (lossy if f.metadata.get("lossy") else p).add_argument(flag, **kw)


def engine_config_from_args(args, defaults: dict | None = None) -> EngineConfig:
    """--config (or the defaults) with every engine flag given on the command line applied.
    defaults: the command's own (serve's prefix cache), under --config and the flags."""
    config = EngineConfig.load(args.config, defaults) if args.config else EngineConfig(**(defaults or {}))
    # sizes are bytes already (argtypes.size); a flag not given is None and changes nothing
    return config.replace(**{name: getattr(args, name) for name in EngineConfig.field_names()})


def add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with the streaming engine")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name (e.g. demo)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    prompt.add_argument("--prompt-tokens", type=positive_int(TOKENS_MAX),
                        help="N token ids drawn deterministically from --seed")
    p.add_argument("--max-new-tokens", type=nonneg_int(TOKENS_MAX), default=32)
    p.add_argument("--seed", type=seed(), default=0, help="seed for --prompt-tokens and sampling")
    # Below 0.01 logits / temperature overflow fp32 to inf and softmax gives NaN probabilities.
    p.add_argument("--temperature", type=finite_float(0.01, 100.0, zero_ok=True), default=0.0,
                   help="0 = greedy, else in [0.01, 100]")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0, help="in (0, 1]")
    add_output_option(p, "--record-routing", kind="file", metavar="FILE",
                      help="write the routing histogram (for cache_policy=pinned)")
    # llama.cpp's flag: the prompt's KV in FILE (engine/run/kv_store.py format); a later run whose
    # prompt begins the same way restores that part instead of computing it.
    add_output_option(p, "--prompt-cache", kind="file", metavar="FILE",
                      help="save the prompt's KV to FILE, and reuse the prefix it shares with a later prompt")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (with prompt and output ids)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    check_output_files(args, "run")
    config = engine_config_from_args(args)
    model_dir = resolve_model(args.model, progress=not args.json)
    result = run(model_dir, config, prompt=args.prompt, prompt_ids=args.prompt_ids,
                 prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                 sampler=Sampler(args.temperature, args.top_p, args.seed),
                 record_routing=args.record_routing, prompt_cache=args.prompt_cache)
    if args.json:
        _print_json(result.to_dict())
        return 0
    if result.text is not None:
        print(result.text)
    else:
        print("output ids:", ",".join(map(str, result.output_ids)))
    print(run_header(result), file=sys.stderr)
    print(run_text(result), file=sys.stderr)
    return 0


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure decode speed: warm-up, then N tokens K times (median, spread)")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name")
    p.add_argument("--tokens", type=positive_int(TOKENS_MAX), default=16, help="decode tokens per repeat")
    p.add_argument("--repeats", type=positive_int(1000), default=3)
    p.add_argument("--prompt-tokens", type=positive_int(TOKENS_MAX), default=16)
    p.add_argument("--seed", type=seed(), default=0)
    temp = p.add_mutually_exclusive_group()
    temp.add_argument("--cold", dest="cold", action="store_true", default=True,
                      help="drop the model's pages and the expert caches before each repeat (default)")
    temp.add_argument("--warm", dest="cold", action="store_false", help="keep caches across repeats")
    p.add_argument("--cgroup-limit", type=size(), help="run inside a child memory cgroup limited to SIZE "
                                                      "(page cache counts)")
    p.add_argument("--timeout", type=seconds(), default=None, help="seconds, with --cgroup-limit")
    add_output_option(p, "--record-routing", kind="file", metavar="FILE",
                      help="write the routing histogram (for cache_policy=pinned)")
    add_output_option(p, "--read-trace", kind="file", metavar="FILE",
                      help="write every decode read (file, offset, bytes, submit and completion time, token, "
                           "layer) as JSON lines, for `benchmarks/io/io_bound.py replay`")
    # The tuner's own: its trial process writes how the run ended here (a fresh path in the trial's
    # temp directory, tuner/search/trial.py), so it is hidden from --help; given by hand, it is
    # refused unless it is a fresh path or a previous outcome record.
    add_output_option(p, "--outcome", kind="file", metavar="FILE", help=argparse.SUPPRESS)
    work = p.add_mutually_exclusive_group()
    work.add_argument("--prompts", metavar="FILE", help="run these prompts in each repeat instead of a random one: "
                                                        "one per line, or JSON Lines of {prompt, max_new_tokens} "
                                                        "(default max_new_tokens: --tokens); needs tokenizer.json")
    work.add_argument("--workload", metavar="FILE", help="tokenized requests as `tune --prompts` saves them "
                                                         "(JSON Lines of {prompt_ids, max_new_tokens})")
    work.add_argument("--steady", type=positive_int(64), metavar="N",
                      help="the steady-decoding workload (tune's default): N prompts of lengths around "
                           "--prompt-tokens from --seed, each sampled for --tokens (the first quarter not counted); "
                           "the figure is the median over the prompts that do not fall into a loop")
    work.add_argument("--trace", metavar="FILE",
                      help="replay a request trace through serve's scheduler in wall time (JSON Lines of {at, "
                           "prompt_ids or prompt, max_tokens[, n]}, e.g. benchmarks/serving/traces/chat_burst.jsonl): "
                           "goodput, TTFT and TPOT p50/p95, queue wait, aggregate tok/s; --max-batch sets the batch")
    p.add_argument("--slo-ttft", type=finite_float(0.0, SLO_MAX_S), metavar="S",
                   help="with --trace: a request meets its SLOs only with its first token within S seconds of its arrival")
    p.add_argument("--slo-tpot", type=finite_float(0.0, SLO_MAX_S), metavar="S",
                   help="with --trace: ... and at most S seconds per generated token after its first")
    work.add_argument("--batch", type=positive_int(256), metavar="B",
                      help="B greedy sequences at once through serve's batch scheduler (random prompts of "
                           "--prompt-tokens from --seed, --seed+1, ...; --tokens each): aggregate and per-sequence "
                           "tok/s, bytes read and experts per step; --max-batch is raised to B")
    p.add_argument("--temperature", type=finite_float(0.01, 100.0, zero_ok=True), default=None,
                   help="with --steady: 0 = greedy, else in [0.01, 100] (default 1.0); with --trace (default 0)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=None,
                   help="with --steady: in (0, 1] (default 0.95); with --trace (default 1)")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def steady_sampling(args) -> tuple[float, float]:
    """(temperature, top_p): the flags, else the workload's defaults (the steady workload samples;
    a trace decodes greedily, as a bench of fixed output lengths should)."""
    if getattr(args, "trace", None):
        return (0.0 if args.temperature is None else args.temperature, 1.0 if args.top_p is None else args.top_p)
    return (STEADY_TEMPERATURE if args.temperature is None else args.temperature,
            STEADY_TOP_P if args.top_p is None else args.top_p)


def _bench_workload(args, model_dir, ctx_size: int):
    """The requests of --prompts / --workload (checked before the engine loads), or None."""
    if args.workload:
        requests, where = load_requests(args.workload), f"--workload {args.workload}"
    elif args.prompts:
        requests, where = load_workload(args.prompts, load_tokenizer(model_dir), args.tokens), f"--prompts {args.prompts}"
    else:
        return None
    # Here, naming the file and the request: generate's own refusal names neither (found by
    # tests/test_fuzz_values.py: a long plain-text line in a prompts file).
    for i, r in enumerate(requests, 1):
        if r.tokens > ctx_size:
            raise PromptError(f"{where}: request {i} needs {r.tokens} tokens ({len(r.prompt_ids)} of prompt + "
                              f"{r.max_new_tokens} new), more than --ctx-size {ctx_size}")
    return requests


def cmd_bench(args) -> int:
    check_output_files(args, "bench")  # first: nothing runs, and a later refusal is recorded in --outcome
    config = engine_config_from_args(args)
    if args.timeout is not None and not args.cgroup_limit:
        raise ConfigError("--timeout goes with --cgroup-limit (a bench without a cgroup runs in this process)")
    if (args.temperature is not None or args.top_p is not None) and not (args.steady or args.trace):
        raise ConfigError("--temperature and --top-p go with --steady or --trace (the other workloads decode greedily)")
    if (args.slo_ttft is not None or args.slo_tpot is not None) and not args.trace:
        raise ConfigError("--slo-ttft and --slo-tpot go with --trace")
    if args.trace:
        read_trace(args.trace)  # a bad trace is one error line before the model is looked for
    model_dir = resolve_model(args.model, progress=not args.json)
    workload = _bench_workload(args, model_dir, config.ctx_size)
    sampling = steady_sampling(args)
    if args.cgroup_limit:
        extra = ["--record-routing", args.record_routing] if args.record_routing is not None else []
        extra += ["--read-trace", args.read_trace] if args.read_trace is not None else []
        extra += ["--prompts", args.prompts] if args.prompts else []
        extra += ["--workload", args.workload] if args.workload else []
        extra += steady_args(args.steady, *sampling) if args.steady else []
        extra += trace_args(args.trace, args.slo_ttft, args.slo_tpot, *sampling) if args.trace else []
        extra += ["--batch", str(args.batch)] if args.batch else []
        trial = run_trial(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=args.cold,
                          prompt_tokens=args.prompt_tokens, seed=args.seed,
                          limit_bytes=args.cgroup_limit, timeout=args.timeout, extra_args=extra)
        if not trial.ok:
            if args.json:
                _print_json(trial.to_dict())
            print(f"colibri bench: error: trial {trial.status}: {trial.error}", file=sys.stderr)
            return 1
        result = BenchResult.from_dict(trial.metrics)
    else:
        def progress(i, n, m):
            if not args.json:
                print(f"  repeat {i}/{n}: decode {m.get('decode_tok_s') or 0:.2f} tok/s", file=sys.stderr)

        result = bench(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=args.cold,
                       prompt_tokens=args.prompt_tokens, seed=args.seed, progress=progress,
                       record_routing=args.record_routing, read_trace=args.read_trace, workload=workload,
                       steady=args.steady or 0, temperature=sampling[0], top_p=sampling[1], batch=args.batch or 0,
                       trace_file=args.trace, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot)
    if args.outcome is not None:
        write_outcome(args.outcome, Outcome("ok", metrics=result.to_dict()))
    if args.json:
        _print_json(result.to_dict())
    else:
        print(bench_text(result))
    return 0
