"""Where one decode token's time goes: read wait, dense compute, expert compute, overhead.

Own timers around the engine's seams, the same in the old and the new tree, so the two are
measured alike (run in one script run with --before-src):

    expert compute   time inside the per-expert math (new tree: Transformer.expert_fn; old
                     tree: model.swiglu, which only the routed experts call on qwen3_moe)
    read wait        the store's own I/O stall counter (time the compute thread blocked on reads)
    MoE overhead     time in the MoE layer minus the two above: routing, the store's Python
                     (cache lookups, read bookkeeping), gathering and summing expert outputs
    dense compute    the rest of the token: attention, norms, router lookahead, lm_head

Each tree runs in its own subprocess (cwd and PYTHONPATH = that tree), cold (bench's
make-cold before the measured generation), decode tokens only (the prefill token excluded).
With --ops, the resident run also prints torch.profiler's top operators of one decode step.

    python benchmarks/token_breakdown.py [--before-src DIR] [--budget 1GiB] [--tokens 8] [--ops]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("read_wait_ms", "expert_ms", "moe_overhead_ms", "dense_ms")


def _timed(fn, acc: dict, key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0
    return wrapper


def child(a) -> dict:
    """Runs inside the tree being measured (its engine is the one on sys.path)."""
    import torch

    import engine.arch.model as model_module
    from engine.run.bench import _make_cold
    from engine.base.config import EngineConfig, parse_size
    from engine.run.generate import Sampler, generate, random_prompt_ids
    from engine.run.runtime import Engine

    cfg = EngineConfig(ram_budget=parse_size(a.budget), ctx_size=512, io_mode=a.io_mode, chunk_size=a.chunk_size,
                       prefetch_depth=a.prefetch_depth, io_threads=a.io_threads, threads=a.threads)
    eng = Engine(a.model, cfg)
    acc = {"expert": 0.0, "moe": 0.0}
    m = eng.model
    if hasattr(m, "expert_fn"):
        m.expert_fn = _timed(m.expert_fn, acc, "expert")
    else:
        model_module.swiglu = _timed(model_module.swiglu, acc, "expert")
    m._moe = _timed(m._moe, acc, "moe")
    prompt = random_prompt_ids(a.prompt_tokens, eng.args.vocab_size, 0)
    generate(eng, prompt, 2, Sampler())  # warm-up
    if a.budget != "0":
        _make_cold(eng)
    store = eng.store

    def after_first(_token, first=[]):
        if not first:
            first.append(True)
            acc["expert"] = acc["moe"] = 0.0
            if store is not None and hasattr(store, "reset_stats"):
                store.reset_stats()

    gen = generate(eng, prompt, a.tokens + 1, Sampler(), on_token=after_first)
    n = len(gen.token_seconds)
    total = sum(gen.token_seconds)
    stall = eng.io_stats().get("io_stall_s", 0.0) or 0.0
    out = {"token_ms": 1000 * total / n, "decode_tok_s": n / total, "read_wait_ms": 1000 * stall / n,
           "expert_ms": 1000 * acc["expert"] / n, "moe_overhead_ms": 1000 * (acc["moe"] - acc["expert"] - stall) / n,
           "dense_ms": 1000 * (total - acc["moe"]) / n, "output_ids": gen.output_ids}
    if a.ops:
        from torch.profiler import ProfilerActivity, profile
        pos = len(prompt) + len(gen.output_ids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.forward([gen.output_ids[-1]], pos)
        out["ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        out["torch_threads"] = torch.get_num_threads()
    eng.close()
    return out


def run_tree(tree: Path, a) -> dict:
    # Imported here, in the parent only: the child must import the measured tree's packages.
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import run_in_tree
    return run_in_tree(__file__, tree, [
        "--model", a.model, "--budget", a.budget, "--tokens", str(a.tokens), "--prompt-tokens", str(a.prompt_tokens),
        "--io-mode", a.io_mode, "--chunk-size", str(a.chunk_size), "--prefetch-depth", str(a.prefetch_depth),
        "--io-threads", str(a.io_threads), "--threads", str(a.threads)] + (["--ops"] if a.ops else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=str(Path.home() / ".cache/colibri/models/demo"))
    ap.add_argument("--budget", default="1GiB", help="0 = resident")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--io-mode", default="direct")
    ap.add_argument("--chunk-size", type=int, default=1 << 20)
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--before-src")
    ap.add_argument("--lock", default="/tmp/colibri-bench.lock")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.child:
        json.dump(child(a), sys.stdout)
        return 0
    # One lock hold for both sides, so before and after see the same box minutes apart.
    with open(a.lock, "a") as lock, contextlib.ExitStack() as stack:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stack.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        sys.path.insert(0, str(ROOT))  # the parent's helpers (see run_tree)
        from benchmarks.trees import measure_sides

        rows = measure_sides(ROOT, a.before_src, lambda tree: run_tree(tree, a))
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    print(f"budget {a.budget}, {a.io_mode}, chunk {a.chunk_size}, prefetch {a.prefetch_depth}, io_threads "
          f"{a.io_threads}, {a.tokens} decode tokens, cold\n")
    print("| side | tok/s | ms/token | read wait | expert compute | MoE overhead | dense compute |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['decode_tok_s']:.2f} | {r['token_ms']:.1f} | "
              + " | ".join(f"{r[c]:.1f}" for c in COLUMNS) + " |")
    for r in rows:
        if "ops" in r:
            print(f"\n{r['side']}: top operators of one decode step ({r['torch_threads']} threads)\n")
            print(r["ops"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
