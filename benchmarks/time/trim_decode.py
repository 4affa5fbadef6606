"""Resident decode under routing trims: untrimmed, top_k_reduction 1 and 2, expert_threshold 0.1,
this tree against another (--before-src: a directory or a git revision, benchmarks/trees.py).

Why: a trim computes fewer experts per token, so it should decode faster; before the trims ran
inside the fused native layers, a trimmed run fell back to the unfused per-layer path and was
slower than the untrimmed one. This prints, per model, trim and tree, the decode tok/s (median
over --runs with min-max), ms per token, the routed experts computed per token (from the routing
log of an untimed second pass), and whether the two trees gave the same tokens.

Each (tree, model) runs in its own subprocess (cwd and PYTHONPATH = that tree), which for each trim
loads the model resident with that EngineConfig.top_k_reduction / expert_threshold, decodes two
tokens of warm-up, then --tokens timed decode steps after a 4-token prompt (the prefill excluded). The trees
alternate per run (after first on odd runs, before first on even ones), so drift of a noisy box
falls on both.

    python benchmarks/time/trim_decode.py [--model demo] [--quant bf16,int8] [--before-src REV]
        [--runs 3] [--tokens 32] [--threads 2] [--json]

--quant: the levels of tune --quant (int8, int4-g64, ...): a quantized level is the model's
container, converted once into the model cache (tuner/search/quant_cache.py) or reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (label, top_k_reduction, expert_threshold)
TRIMS = (("untrimmed", 0, 0.0), ("k-1", 1, 0.0), ("k-2", 2, 0.0), ("threshold 0.1", 0, 0.1))


def child(a) -> dict:
    import torch

    from engine.api import EngineConfig
    from engine.api import Sampler, generate, random_prompt_ids
    from engine.api import Engine

    out = {}
    for label, reduction, threshold in TRIMS:  # the trim is an engine setting: one engine per trim
        config = EngineConfig(ram_budget=0, ctx_size=512, threads=a.threads, top_k_reduction=reduction,
                              expert_threshold=threshold)
        with Engine(a.model, config) as eng:
            prompt = random_prompt_ids(4, eng.args.vocab_size, 0)
            generate(eng, prompt, 2, Sampler())  # warm-up: kernels, thread pool, the fused layers' tables
            gen = generate(eng, prompt, a.tokens + 1, Sampler())
            token_s = sum(gen.token_seconds) / len(gen.token_seconds)  # decode steps only
            # Experts per token from the routing log (a second, untimed pass: logging takes the unfused path).
            eng.record_routing()
            logged = generate(eng, prompt, a.tokens + 1, Sampler())
            calls = [ids for layer in eng.model.routing_log for ids in layer if ids.shape[0] == 1]
            decode_steps = len(calls) // max(1, sum(1 for layer in eng.model.routing_log if layer))
            out[label] = {"decode_tok_s": 1 / token_s, "token_ms": 1000 * token_s, "output_ids": gen.output_ids,
                          "logged_ids_equal": logged.output_ids == gen.output_ids,
                          "experts_per_token": sum(int((ids >= 0).sum()) for ids in calls) / max(1, decode_steps)}
    return {"model": a.model, "threads": torch.get_num_threads(), "trims": out}


def _models(a) -> list[tuple[str, str]]:
    """(label, directory) per --quant level, containers converted once or reused."""
    sys.path.insert(0, str(ROOT))
    from engine.api import resolve_model
    from tuner.search import quant_cache
    from tuner.search.quant_tune import parse_levels

    source = resolve_model(a.model)
    out = []
    for level in parse_levels(a.quant):
        if level.quant is None:
            out.append((level.label, str(source)))
        else:
            path, _ = quant_cache.ensure_container(source, level, lambda line: print(line, file=sys.stderr))
            out.append((level.label, str(path)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="model directory or synth preset (default demo)")
    ap.add_argument("--quant", default="bf16,int8", help="levels to measure, as tune --quant (default bf16,int8)")
    ap.add_argument("--before-src", help="the tree to compare with: a directory or a git revision")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of tables")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if a.runs < 1 or a.tokens < 1:
        print("trim_decode: error: --runs and --tokens must be positive", file=sys.stderr)
        return 2
    models = _models(a)
    from benchmarks.trees import run_in_tree, source_tree

    rows = []
    import contextlib
    with contextlib.ExitStack() as stack:
        trees = [("after", ROOT)] + ([("before", stack.enter_context(source_tree(a.before_src)))]
                                     if a.before_src else [])
        for run in range(a.runs):
            for label, path in models:
                for side, tree in (trees if run % 2 == 0 else trees[::-1]):
                    print(f"run {run + 1}/{a.runs}: {label} {side} ({tree}) ...", file=sys.stderr)
                    got = run_in_tree(__file__, tree, ["--model", path, "--tokens", str(a.tokens),
                                                       "--threads", str(a.threads)])
                    for trim, r in got["trims"].items():
                        rows.append({"model": label, "side": side, "run": run + 1, "trim": trim, **r})
    if a.json:
        from benchmarks.benchkit import emit, run_conditions  # the parent only: the child prints its wire JSON
        emit('trim_decode', rows, run_conditions(a), True, [])
        return 0
    print_table(rows, a)
    return 0


def print_table(rows: list[dict], a) -> None:
    print(f"resident decode, {a.tokens} decode tokens after a 4-token prompt, {a.threads} threads, "
          f"{a.runs} runs per side; tok/s median (min-max)\n")
    print("| model | trim | side | tok/s | ms/token | experts/token | after/before (medians) | tokens equal across sides |")
    print("|---|---|---|---|---|---|---|---|")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["trim"]), {}).setdefault(r["side"], []).append(r)
    for (model, trim), sides in groups.items():
        med = {s: statistics.median(x["decode_tok_s"] for x in rs) for s, rs in sides.items()}
        outputs = {tuple(x["output_ids"]) for rs in sides.values() for x in rs}
        for side, rs in sides.items():
            tok = [x["decode_tok_s"] for x in rs]
            ratio = f"{med['after'] / med['before']:.2f}x" if side == "after" and "before" in med else ""
            print(f"| {model} | {trim} | {side} | {med[side]:.2f} ({min(tok):.2f}-{max(tok):.2f}) | "
                  f"{statistics.median(x['token_ms'] for x in rs):.2f} | "
                  f"{statistics.median(x['experts_per_token'] for x in rs):.1f} | {ratio} | "
                  f"{'yes' if len(outputs) == 1 else 'no'} |")


if __name__ == "__main__":
    sys.exit(main())
