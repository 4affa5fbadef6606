"""`colibri serve` (the tuned engine behind an OpenAI-compatible API) and `colibri chat`."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from engine.api import (ConfigError, EngineConfig, default_ctx_size, is_kv_root, kv_root, parse_size,
                        read_text_input, resolve_model, run_directory_target)
from colibri.serve.chat import chat_loop
from colibri.serve.protocol import ApiError, Sampling, parse_sampling
from colibri.serve.jobs import GATHER_CAP
from colibri.serve.server import (API_KEY_ENV, DEFAULT_GATHER_MS, MAX_GATHER_MS, LoadedModel, ServeOptions,
                                  check_options, serve)
from colibri.commands.argtypes import add_output_option, finite_float, int_in, positive_int, seed, size
from colibri.commands.run import TOKENS_MAX, model_sources, add_engine_flags, engine_config_from_args

# Prefix reuse is on in serve and chat (llama-server's cache_prompt is on by default): RAM for
# 256 MiB of KV blocks, or an eighth of a memory budget when that is less (the plan charges it,
# so it is taken from the expert cache); `--prefix-cache 0` turns it off.
PREFIX_CACHE_DEFAULT = 256 << 20
# KV blocks that leave RAM go to the SSD, at most this much per model (oldest first out).
KV_DISK_DEFAULT = 8 << 30


def default_prefix_cache(ram_budget: int) -> int:
    return PREFIX_CACHE_DEFAULT if not ram_budget else min(PREFIX_CACHE_DEFAULT, ram_budget // 8 >> 20 << 20)


def add_reuse_flags(p) -> None:
    add_output_option(p, "--kv-dir", kind="run directory", metavar="DIR",
                      help="where KV blocks go when they leave the prefix cache, found again by later prompts "
                           f"and after a restart (default: {kv_root()})")
    p.add_argument("--kv-disk", type=size(zero_ok=True, zero_means="KV in RAM only"), default=KV_DISK_DEFAULT,
                   help="most bytes of KV blocks --kv-dir holds per model; the oldest go first (0: RAM only; "
                        "default 8GiB)")


def say_prefix_default(p) -> None:
    """--prefix-cache's help names serve's default, not the knob's (0, run's)."""
    for action in p._actions:
        if action.dest == "prefix_cache":
            action.help = ("RAM for the KV of recent prompts, reused when a later prompt begins the same way "
                           "(default here: 256MiB, or an eighth of --ram-budget when less; 0 = off)")


def reuse_options(args, command: str) -> tuple[EngineConfig, dict]:
    """The engine config with serve's defaults (under --config and the flags): the prefix cache; and
    the SSD tier's directory (checked by the output guard before anything loads) and bound.

    The prefill group stays the engine's (--prefill-chunk, else the plan's: the whole context without
    a budget, the largest that fits under one, engine/movement/plan.py prefill_group_for), and a
    prompt with nothing decoding beside it goes through in it. A newcomer does not stall the running
    streams for its whole group: while they decode, the batch scheduler prefills it at most one
    sub-chunk (PREFILL_CHUNK tokens) per pass between their steps (engine/run/batch.py, stall_tokens)."""
    given = engine_config_from_args(args)
    config = engine_config_from_args(args, defaults={"prefix_cache": default_prefix_cache(given.ram_budget)})
    if config.draft != "off" and config.max_batch > 1:  # before the model loads (the worker checks it too)
        raise ConfigError("speculative decoding (--draft) runs one sequence at a time: it goes with --max-batch 1")
    if not config.prefix_cache or not args.kv_disk:
        return config, {}
    kv_dir = run_directory_target(args.kv_dir if args.kv_dir is not None else kv_root(), command=command,
                                  recognise=is_kv_root, sources=model_sources(args), flag="--kv-dir")
    return config, {"kv_dir": kv_dir, "kv_disk_bytes": args.kv_disk}


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (--max-batch requests "
                                     "decoded together; default one at a time)")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name (e.g. demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000)
    p.add_argument("--api-key", help=f"required for a non-loopback --host (or set {API_KEY_ENV})")
    p.add_argument("--queue-size", type=positive_int(100_000), default=8, help="requests that may wait; more get 503 + Retry-After")
    p.add_argument("--max-body", default="4MiB", help="largest request body accepted")
    p.add_argument("--gather-ms", type=finite_float(0.0, float(MAX_GATHER_MS)), default=DEFAULT_GATHER_MS,
                   help="with --max-batch > 1, an idle server waits until requests stop arriving for this long "
                        f"(at most {GATHER_CAP}x it) so simultaneous ones share one prefill pass; 0 = start at once "
                        "(default %(default)g)")
    p.add_argument("--model-name", help="the model id clients use (default: the directory's name)")
    add_reuse_flags(p)
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (scheme://host[:port], or *) call the API; repeatable; "
                        "off by default")
    add_engine_flags(p)
    say_prefix_default(p)
    p.set_defaults(func=cmd_serve)


def _with_context(args, config: EngineConfig, model_dir, log) -> EngineConfig:
    """--ctx-size (or --config's ctx_size) when given; else the model's max_position_embeddings
    capped by the memory plan (engine/run/context.py), said once in the log."""
    if args.ctx_size is not None or (args.config and "ctx_size" in _config_keys(args.config)):
        return config
    ctx, why = default_ctx_size(model_dir, config)
    log(f"colibri: context {ctx} tokens ({why})")
    return config.replace(ctx_size=ctx)


def _config_keys(path) -> set[str]:
    # Already read and checked by EngineConfig.load; read again for which keys it names.
    data = tomllib.loads(read_text_input(Path(path), "engine config", ConfigError))
    return set(data["engine"] if set(data) == {"engine"} else data)


def cmd_serve(args) -> int:
    # The model id clients send: what the user typed for a preset ("demo"), else the directory's name.
    name = args.model_name or Path(args.model).name
    opts = check_options(ServeOptions(args.host, args.port, args.api_key, args.queue_size,
                                      parse_size(args.max_body), name, tuple(args.cors_origin), args.gather_ms))
    config, reuse = reuse_options(args, "serve")
    model_dir = resolve_model(args.model, progress=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    serve(model_dir, _with_context(args, config, model_dir, log), opts, log=log, **reuse)
    return 0


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk to the model in the terminal (streamed answers, a speed line each)")
    p.add_argument("--model", required=True, help="model directory, or a synth preset name (e.g. demo)")
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--max-tokens", type=positive_int(TOKENS_MAX), default=256, help="longest answer, in tokens")
    p.add_argument("--temperature", type=finite_float(0.01, 100.0, zero_ok=True), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--seed", type=seed(), default=0)
    add_reuse_flags(p)
    add_engine_flags(p)
    say_prefix_default(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    # The same checks a request gets (ranges, finite numbers), through the same parser.
    try:
        sampling: Sampling = parse_sampling({"max_tokens": args.max_tokens, "temperature": args.temperature,
                                             "top_p": args.top_p, "seed": args.seed}, args.max_tokens)
    except ApiError as exc:
        raise ConfigError(f"--{exc.param.replace('_', '-')}: {exc.message.split(': ', 1)[-1]}") from None
    config, reuse = reuse_options(args, "chat")
    model_dir = resolve_model(args.model, progress=True)
    config = _with_context(args, config, model_dir, lambda m: None)
    model = LoadedModel(model_dir, config, queue_size=1, **reuse)
    try:
        return chat_loop(model, sampling, system=args.system)
    finally:
        model.close()
