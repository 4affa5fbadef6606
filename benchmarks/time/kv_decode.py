"""Decode speed at a long context with each KV-cache precision (kv_dtype auto / int8 / fp8), two trees.

Why: a quantized KV cache halves the bytes a decode step reads from the cache (1 byte a number
plus one fp32 scale per token per head, against bf16's 2), but it only pays where the attention
that reads it is as fast as the bf16 one. Until the native attention read codes and scales
(attention_kernels.h, KvRows), an int8 / fp8 run fell off the fused attention and the whole-step
call onto torch's ops, which dequantize every cached row of every layer per token.

What one measurement is: the model resident (budget 0), one Engine per kv_dtype at --ctx
positions; a prompt of random ids prefilled up to the first context (2048 by default), one
untimed decode step, then --tokens timed decode steps (greedy); the same sequence continued by
prefilling the prompt's next tokens up to the next context (4096), and --tokens more timed
steps there. So the 4096 figure attends 4096-4128 positions, the 2048 one 2048-2080. Per step
the script records which native path ran (whole step = decode_layers_bf16, per layer =
attention_decode_bf16, none = torch's ops), counted by wrapping the engine's native module.

Columns: decode tok/s (timed steps / their summed seconds), ms per token, the KV cache's bytes
per position (codes + scales, from the plan), the cache bytes one step reads at that context
(positions x bytes per position), and the path. The medians table gives, per kv_dtype and
context, the median over rounds with min-max, after / before, and the KV slope: how many ms a
token's time grows from the first context to the second (the cost of 2048 more cached
positions; the rest of the step is the same weights either way).

Each (tree, round) runs in its own subprocess (cwd and PYTHONPATH = that tree, benchmarks/trees.py);
--rounds alternates the trees (after, before, after, ...).

    python benchmarks/time/kv_decode.py [--model demo] [--before-src REV] [--rounds 3] [--tokens 32]
        [--contexts 2048,4096] [--ctx 4608] [--kv-dtypes auto,int8,fp8] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("decode_layers", "attention_decode")  # the engine's native entry points, whole step first


def child(a) -> dict:
    import torch

    from engine.api.lab import native
    from engine.api import EngineConfig
    from engine.api import random_prompt_ids
    from engine.api import Engine

    calls = dict.fromkeys(PATHS, 0)
    for name in PATHS:  # the model looks these up on the module at each call
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        setattr(native, name, counted)
    torch.set_num_threads(a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    rows = []
    for kv_dtype in a.kv_dtypes.split(","):
        config = EngineConfig(ram_budget=0, ctx_size=a.ctx, threads=a.threads, kv_dtype=kv_dtype)
        with Engine(a.model, config) as eng:
            prompt = random_prompt_ids(contexts[-1], eng.args.vocab_size, 0)
            kv_per_position = eng.plan.kv_bytes / a.ctx
            pos = 0
            for context in contexts:
                t0 = time.perf_counter()
                logits = eng.forward(prompt[pos:context], pos, last_only=True)
                prefill_s = time.perf_counter() - t0
                pos = context
                token = int(logits[-1].argmax())
                logits = eng.forward([token], pos)  # untimed: the first step's one-time costs (operands, rope row)
                token, pos = int(logits[-1].argmax()), pos + 1
                before = dict(calls)
                seconds = []
                for _ in range(a.tokens):
                    t = time.perf_counter()
                    logits = eng.forward([token], pos)
                    token = int(logits[-1].argmax())
                    seconds.append(time.perf_counter() - t)
                    pos += 1
                ran = {k: calls[k] - before[k] for k in PATHS}
                path = ("whole step" if ran["decode_layers"] == a.tokens else
                        "per layer" if ran["attention_decode"] else "torch ops" if not ran["decode_layers"] else "mixed")
                rows.append({"kv_dtype": kv_dtype, "context": context, "decode_tok_s": len(seconds) / sum(seconds),
                             "token_ms": 1000 * statistics.median(seconds), "prefill_s": prefill_s,
                             "kv_bytes_per_position": kv_per_position,
                             "kv_read_mib": context * kv_per_position / 2 ** 20, "path": path})
    return {"rows": rows, "threads": torch.get_num_threads()}


def run_tree(tree: Path, model: str, a) -> dict:
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import run_in_tree
    return run_in_tree(__file__, tree, ["--model", model, "--tokens", str(a.tokens), "--contexts", a.contexts,
                                        "--ctx", str(a.ctx), "--kv-dtypes", a.kv_dtypes, "--threads", str(a.threads)],
                       timeout=3600)


def _fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def print_tables(runs: list[dict], a) -> None:
    print(f"decode, resident, kv_dtype {a.kv_dtypes}, ctx_size {a.ctx}, {a.tokens} timed decode tokens at each "
          f"context {a.contexts}, {a.threads} threads, {a.rounds} rounds\n")
    print("| side | round | kv_dtype | context | decode tok/s | ms/token (median step) | KV B/position |"
          " KV read/step MiB | prefill s | path | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for r in run["rows"]:
            print(f"| {run['side']} | {run['round'] + 1} | {r['kv_dtype']} | {r['context']} | {r['decode_tok_s']:.2f} |"
                  f" {r['token_ms']:.1f} | {r['kv_bytes_per_position']:.0f} | {r['kv_read_mib']:.1f} |"
                  f" {r['prefill_s']:.1f} | {r['path']} | {run['load_avg_1m']:.2f} |")
    sides = list(dict.fromkeys(run["side"] for run in runs))
    contexts = [int(c) for c in a.contexts.split(",")]
    tok_s: dict = {}
    ms: dict = {}
    paths: dict = {}
    for run in runs:
        for r in run["rows"]:
            key = (run["side"], r["kv_dtype"], r["context"])
            tok_s.setdefault(key, []).append(r["decode_tok_s"])
            ms.setdefault(key, []).append(1000 / r["decode_tok_s"])
            paths[key] = r["path"]
    print("\nmedians over rounds (min-max)\n")
    head = "| kv_dtype | context | " + " | ".join(f"{s} tok/s | {s} path" for s in sides)
    print(head + (" | after / before |" if len(sides) == 2 else " |"))
    print("|---|---|" + "---|---|" * len(sides) + ("---|" if len(sides) == 2 else ""))
    for kv_dtype in a.kv_dtypes.split(","):
        for context in contexts:
            cells = [f"{_fmt(tok_s[(s, kv_dtype, context)])} | {paths[(s, kv_dtype, context)]}" for s in sides]
            ratio = ""
            if len(sides) == 2:
                ratio = f" | {statistics.median(tok_s[('after', kv_dtype, context)]) / statistics.median(tok_s[('before', kv_dtype, context)]):.2f}x"
            print(f"| {kv_dtype} | {context} | " + " | ".join(cells) + ratio + " |")
    if len(contexts) >= 2:
        first, last = contexts[0], contexts[-1]
        print(f"\nKV slope: ms per token at context {last} minus at {first} (per round, median (min-max))\n")
        print("| kv_dtype | " + " | ".join(f"{s} ms" for s in sides) + " |")
        print("|---|" + "---|" * len(sides))
        for kv_dtype in a.kv_dtypes.split(","):
            cells = []
            for s in sides:
                slope = [b - f for f, b in zip(ms[(s, kv_dtype, first)], ms[(s, kv_dtype, last)])]
                cells.append(_fmt(slope, 1))
            print(f"| {kv_dtype} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="demo", help="model directory or synth preset (default demo)")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens at each context (default 32)")
    ap.add_argument("--contexts", default="2048,4096", help="comma-separated prompt lengths, ascending")
    ap.add_argument("--ctx", type=int, default=4608, help="the KV cache's ctx_size (default 4608)")
    ap.add_argument("--kv-dtypes", default="auto,int8,fp8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before-src", help="a second tree (the old code: a directory or a revision) in the same run")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the trees alternating (after, before, ...)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        contexts = [int(c) for c in a.contexts.split(",")]
    except ValueError:
        print(f"kv_decode: error: --contexts {a.contexts!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    if contexts != sorted(set(contexts)) or contexts[0] < 1 or contexts[-1] + a.tokens + 1 > a.ctx:
        print(f"kv_decode: error: --contexts must ascend, each >= 1, and the last + --tokens + 1 fit --ctx {a.ctx}",
              file=sys.stderr)
        return 2
    if a.child:
        json.dump(child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import alternate_sides
    from engine.api import resolve_model

    model = str(resolve_model(a.model))  # once, so every tree reads the same synthesized directory
    runs = alternate_sides(ROOT, a.before_src, a.rounds, lambda tree: run_tree(tree, model, a))
    if a.json:
        from benchmarks.benchkit import emit, run_conditions  # the parent only: the child prints its wire JSON
        emit('kv_decode', runs, run_conditions(a), True, [])
        return 0
    print_tables(runs, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
