"""A long newcomer beside running streams: their worst wait between two tokens and its TTFT, with the
batch scheduler's cap on a newcomer's prefill pass (engine/run/batch.py, stall_tokens) and without it.

One engine in this process (the config's budget, --max-batch caches), serve's scheduler driven
directly (no HTTP): --streams sequences of --stream-prompt seeded token ids start together and
decode greedily; after --after steps of theirs a newcomer of --newcomer-tokens seeded ids is
submitted. Its prefill goes in passes between the streams' decode steps: at most --stall tokens a
pass with the cap (one sub-chunk by default), the plan's group without (which under a budget can be
the whole context). The streams generate enough tokens to decode through the newcomer's whole
prefill either way. Rounds alternate which setting goes first; every figure is each setting's
median (min-max) over --rounds (--json: one colibri.bench/1 document, benchkit.emit; --lock FILE:
benchkit.bench_lock around each measured round).

Per setting: the streams' worst gap between two tokens (the client's stall) and their median gap,
the newcomer's TTFT (from its admission), its prefill passes, and the expert bytes read from its
submission to its first token (a capped newcomer reads the routed experts again each pass). The
engine is warm after the first round (its expert cache keeps what the previous round read), so the
setting that goes first is not privileged: rounds alternate.

    .venv/bin/python benchmarks/serving/newcomer_stall.py --model demo --ram-budget 2GiB --rounds 2
    .venv/bin/python benchmarks/serving/newcomer_stall.py --model tiny --ram-budget 0 --newcomer-tokens 200 --stall 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.api import (PREFILL_CHUNK, BatchSequence, Decoding, Engine, EngineConfig, Sampler, Scheduler,  # noqa: E402
                        parse_size, random_prompt_ids, resolve_model)
from benchmarks import benchkit  # noqa: E402

TOOL = "newcomer_stall"


def one_round(engine, args, stall: int, seed: int) -> dict:
    """The streams, then the newcomer after --after of their steps; the figures of one setting."""
    sched = Scheduler(engine, stall_tokens=stall)
    vocab = engine.args.vocab_size
    streams = [BatchSequence(Decoding(engine, random_prompt_ids(args.stream_prompt, vocab, seed=seed + i),
                                      args.stream_tokens, Sampler())) for i in range(args.streams)]
    newcomer = BatchSequence(Decoding(engine, random_prompt_ids(args.newcomer_tokens, vocab, seed=seed + 99), 2,
                                      Sampler()))
    for s in streams:
        sched.submit(s)
    steps = passes = 0
    read_at = read_until = None
    while sched.active:
        if steps == args.after:
            sched.submit(newcomer)
            read_at = _bytes_read(engine)
        prefilling = read_at is not None and newcomer.first_token_at is None
        info = sched.step()
        steps += 1
        passes += prefilling and info.prefill_tokens > 0
        if read_at is not None and read_until is None and newcomer.first_token_at is not None:
            read_until = _bytes_read(engine)
    gaps = [g for s in streams for g in s.decoding.gen.token_seconds]
    if any(s.last_token_at is not None and s.last_token_at < newcomer.first_token_at for s in streams):
        raise SystemExit("a stream ended before the newcomer's first token: raise --stream-tokens")
    return {"worst_gap_s": max(gaps), "median_gap_s": statistics.median(gaps),
            "newcomer_ttft_s": newcomer.decoding.gen.ttft_seconds, "passes": passes,
            "read_mib": None if read_at is None or read_until is None else (read_until - read_at) / (1 << 20)}


def _bytes_read(engine) -> int:
    store = engine.store
    stats = getattr(store, "io_stats", None) if store is not None and store.streams else None
    return stats.snapshot()["bytes_read"] if stats is not None else 0


def _fmt(values: list, digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mid = statistics.median(values)
    return f"{mid:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else f"{mid:.{digits}f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--config", help="engine config TOML (its budget, io mode, ...)")
    p.add_argument("--ram-budget", default="2GiB", help="the engine's budget (0: none, resident)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--ctx-size", type=int, default=2048)
    p.add_argument("--streams", type=int, default=3, help="sequences decoding when the newcomer comes")
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=24)
    p.add_argument("--after", type=int, default=3, help="the streams' steps before the newcomer comes")
    p.add_argument("--newcomer-tokens", type=int, default=1900)
    p.add_argument("--stall", type=int, default=PREFILL_CHUNK, help="the cap's tokens per pass (default: one sub-chunk)")
    p.add_argument("--rounds", type=int, default=2)
    benchkit.add_output_flags(p)
    args = p.parse_args(argv)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    if args.streams + 1 > args.max_batch:
        p.error("--max-batch must hold the streams and the newcomer")
    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    config = config.replace(max_batch=args.max_batch, ctx_size=args.ctx_size, prefix_cache=0,
                            ram_budget=parse_size(args.ram_budget) if args.ram_budget != "0" else 0)
    engine = Engine(resolve_model(args.model, progress=False), config)
    results: dict[str, list[dict]] = {"cap": [], "no cap": []}
    try:
        group = engine.prefill_group_tokens(engine.kv, args.newcomer_tokens)
        for rnd in range(args.rounds):
            order = (("cap", args.stall), ("no cap", 0)) if rnd % 2 == 0 else (("no cap", 0), ("cap", args.stall))
            for name, stall in order:
                with benchkit.bench_lock(args.lock):
                    r = one_round(engine, args, stall, seed=1000 + 10 * rnd)
                results[name].append(r)
                say(f"round {rnd + 1} {name}: worst gap {r['worst_gap_s']:.2f} s, newcomer TTFT "
                    f"{r['newcomer_ttft_s']:.2f} s in {r['passes']} passes")
    finally:
        engine.close()
    cond = benchkit.run_conditions(args, io_mode=config.io_mode, prefill_group=group)
    rows = [{"setting": f"{name} ({args.stall} tokens a pass)" if name == "cap" else "no cap (the plan's group)",
             "worst": _fmt([r["worst_gap_s"] for r in rs]), "median": _fmt([r["median_gap_s"] for r in rs], 3),
             "ttft": _fmt([r["newcomer_ttft_s"] for r in rs]), "passes": _fmt([r["passes"] for r in rs], 0),
             "read": _fmt([r["read_mib"] for r in rs], 0)} for name, rs in results.items()]
    benchkit.emit(TOOL, rows, cond, args.json, [("setting", lambda r: r["setting"]),
                                                 ("streams' worst gap s", lambda r: r["worst"]),
                                                 ("streams' median gap s", lambda r: r["median"]),
                                                 ("newcomer TTFT s", lambda r: r["ttft"]),
                                                 ("newcomer passes", lambda r: r["passes"]),
                                                 ("expert MiB read to its first token", lambda r: r["read"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
