"""Where one resident decode step's time goes, per part of the model, in one or two trees.

Own timers (time.perf_counter) around seams that exist in every tree measured, so the old and
the new code are cut at the same places:

    attention       Transformer._attention: q/k/v/o projections, q/k norms, rope, KV write, SDPA
    router          the MoE layer's routing call (route_layer): router matmul, softmax, top-k
    experts         the rest of Transformer._moe: the selected experts' matmuls, SwiGLU, the
                    weighted sum of their outputs (and the store's lookups)
    layer rest      the rest of Transformer._layer: the two RMSNorms, residual adds, Python
    head            the rest of forward(): embedding, rope tables, final norm, lm_head

Then torch.profiler over one more decode step: the number of aten calls per step (each costs
Python + dispatcher time on top of its kernel), how many of them allocate (aten::empty*), and
the top operators by self CPU time.

Each tree runs in its own subprocess (cwd and PYTHONPATH = that tree), weights resident (no
budget), warm (two tokens of warm-up), `--tokens` decode steps timed after a prefill.

    python benchmarks/decode_profile.py [--before-src DIR] [--model DIR] [--tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("attention", "router", "experts", "layer_rest", "head")


def _wrap(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0
    setattr(obj, name, timed)


def child(a) -> dict:
    import torch

    from engine.base.config import EngineConfig
    from engine.run.generate import Sampler, generate, random_prompt_ids
    from engine.run.runtime import Engine

    eng = Engine(a.model, EngineConfig(ram_budget=0, ctx_size=512, threads=a.threads))
    m = eng.model
    acc: dict = defaultdict(float)
    # The MoE layer looks route_layer up in its own module's globals (split trees: where
    # Transformer is defined), so patch it there.
    moe_globals = type(m)._moe.__globals__
    # Trees before the strategy objects (32851d0) call `route` there, later ones `route_layer`.
    route_name = "route_layer" if "route_layer" in moe_globals else "route"
    orig_route = moe_globals[route_name]

    def route_timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig_route(*args, **kwargs)
        finally:
            acc["router"] += time.perf_counter() - t0
    moe_globals[route_name] = route_timed
    for name, key in (("_attention", "attention_total"), ("_moe", "moe_total"), ("_layer", "layer_total"),
                      ("forward", "step_total")):
        _wrap(m, name, acc, key)
    prompt = random_prompt_ids(a.prompt_tokens, eng.args.vocab_size, 0)
    generate(eng, prompt, 2, Sampler())  # warm-up: kernels, thread pool, first-touch of KV pages

    steps = []

    def on_token(_token, steps=steps):
        steps.append(dict(acc))

    gen = generate(eng, prompt, a.tokens + 1, Sampler(), on_token=on_token)
    first, last = steps[0], steps[-1]
    n = len(steps) - 1  # decode steps after the prefill token
    d = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / n for k in last}
    token_s = sum(gen.token_seconds) / len(gen.token_seconds)  # decode steps only (no prefill)
    parts = {"attention": d["attention_total"], "router": d.get("router", 0.0),
             "experts": d["moe_total"] - d.get("router", 0.0),
             "layer_rest": d["layer_total"] - d["attention_total"] - d["moe_total"],
             "head": d["step_total"] - d["layer_total"]}
    out = {"token_ms": 1000 * token_s, "decode_tok_s": 1 / token_s, "threads": torch.get_num_threads(),
           "parts_ms": {k: 1000 * v for k, v in parts.items()},
           "outside_forward_ms": 1000 * (token_s - d["step_total"]), "output_ids": gen.output_ids}
    from torch.profiler import ProfilerActivity, profile
    pos = len(prompt) + len(gen.output_ids)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.forward([gen.output_ids[-1]], pos)
    events = prof.key_averages()
    out["aten_calls"] = sum(e.count for e in events if e.key.startswith("aten::"))
    out["alloc_calls"] = sum(e.count for e in events if e.key.startswith("aten::empty"))
    out["ops"] = events.table(sort_by="self_cpu_time_total", row_limit=14)
    eng.close()
    return out


def run_tree(tree: Path, a) -> dict:
    # Imported here, in the parent only: the child must import the measured tree's packages.
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import run_in_tree
    return run_in_tree(__file__, tree, ["--model", a.model, "--tokens", str(a.tokens), "--prompt-tokens",
                                        str(a.prompt_tokens), "--threads", str(a.threads)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=str(Path.home() / ".cache/colibri/models/demo"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before-src", help="a second tree (the old code) measured in the same run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.child:
        json.dump(child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))  # the parent's helpers (see run_tree)
    from benchmarks.trees import measure_sides

    rows = measure_sides(ROOT, a.before_src, lambda tree: run_tree(tree, a))
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    print(f"resident decode, {a.tokens} decode tokens after a {a.prompt_tokens}-token prompt, {a.threads} threads,"
          f" ms per token\n")
    print("| side | tok/s | ms/token | " + " | ".join(PARTS) + " | outside forward | aten calls/step | allocs/step | load |")
    print("|---|---|---|" + "---|" * len(PARTS) + "---|---|---|---|")
    for r in rows:
        p = r["parts_ms"]
        print(f"| {r['side']} | {r['decode_tok_s']:.2f} | {r['token_ms']:.2f} | "
              + " | ".join(f"{p[k]:.2f}" for k in PARTS)
              + f" | {r['outside_forward_ms']:.2f} | {r['aten_calls']} | {r['alloc_calls']} | {r['load_avg_1m']:.2f} |")
    if len(rows) == 2 and rows[0]["output_ids"] != rows[1]["output_ids"]:
        print("\nnote: the two trees produced different tokens")
    elif len(rows) == 2:
        print("\nboth trees produced the same tokens")
    for r in rows:
        print(f"\n{r['side']}: top operators of one decode step ({r['threads']} threads)\n")
        print(r["ops"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
