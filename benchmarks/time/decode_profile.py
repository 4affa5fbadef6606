"""Where one decode token's time goes: per part, per layer, per operator (native vs torch), Python between ops.

One script for what decode_profile.py (resident, per part) and token_breakdown.py (cold, read
wait) measured apart before. Own timers (time.perf_counter) around seams every tree has, so the
old and the new code are cut at the same places:

    attention       Transformer._attention: q/k/v/o projections, q/k norms, rope, KV write, SDPA
                    (or _decode_attention, the one native call for all of it, input norm included)
    router          the MoE layer's routing call (route_layer): router matmul, softmax, top-k
    experts         the rest of Transformer._moe: the selected experts' matmuls, SwiGLU, the
                    weighted sum (and the store's lookups); minus read wait when streaming (or
                    _resident_moe_call, the fused layer: norm and router included, so router is 0)
    read wait       the store's own I/O stall counter (cold runs: --budget > 0)
    layer rest      the rest of Transformer._layer: the two RMSNorms, residual adds, lookahead
    layers one call Transformer._decode_step: every layer in one native call (decode_step.cpp), where
                    the engine's decode plan takes it (engine/arch/decode_plan.py; the route is
                    printed); then the per-layer parts above are 0 (--per-layer-calls splits them)
    head            the rest of forward(): embedding, rope tables, final norm, lm_head
    outside forward sampling and the generation loop

Per layer: the same timers keyed by layer (attention / MoE / rest, ms per token).

Then torch.profiler over --profile-steps more decode steps: every top-level operator the step
dispatches (one row per name: calls and ms per step, native = our colibri:: ops, torch =
aten::), and "Python between ops" = the step's wall time minus the time inside top-level
operators — the interpreter's share. The profiler adds its own cost per op (~µs), so its rows
are read as shares of the profiled step, next to the unprofiled ms per token above.

Each (tree, model) runs in its own subprocess (cwd and PYTHONPATH = that tree), two tokens of
warm-up, `--tokens` decode steps timed after a prefill (the prefill token excluded). Resident by
default (--budget 0); --budget 1GiB makes it cold (the store's make_cold before the measured
generation), as token_breakdown.py did.

    python benchmarks/time/decode_profile.py --model DIR [--model DIR2 ...] [--before-src TREE]
        [--rounds 3] [--per-layer-calls] [--tokens 32] [--threads 2] [--budget 0] [--io-mode direct] [--json]

--rounds N alternates the trees N times (after, before, after, ...) and adds a table of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("layers_one_call", "attention", "router", "experts", "read_wait", "layer_rest", "head", "outside_forward")


def _wrap(obj, name: str, acc: dict, key: str, per_layer: dict | None = None) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            acc[key] += dt
            if per_layer is not None:
                per_layer[args[0]] += dt  # _layer / _attention / _moe take the layer index first
    setattr(obj, name, timed)


def _op_table(prof, wall_s: float, steps: int) -> dict:
    """Top-level operators of the profiled steps: per name calls and ms per step; Python = the rest."""
    by_name: dict = defaultdict(lambda: [0, 0.0])
    inside = 0.0
    for ev in prof.profiler.function_events:
        if ev.cpu_parent is not None or ev.name.startswith("ProfilerStep"):
            continue
        by_name[ev.name][0] += 1
        by_name[ev.name][1] += ev.cpu_time_total / 1e6
        inside += ev.cpu_time_total / 1e6
    rows = sorted(([name, n / steps, 1000 * s / steps] for name, (n, s) in by_name.items()), key=lambda r: -r[2])
    native_ms = sum(r[2] for r in rows if r[0].startswith("colibri"))
    return {"ops": rows, "native_ms": native_ms, "torch_ms": 1000 * inside / steps - native_ms,
            "python_ms": 1000 * (wall_s - inside) / steps, "profiled_step_ms": 1000 * wall_s / steps,
            "calls": sum(r[1] for r in rows)}


def child(a) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.api import EngineConfig, parse_size
    from engine.api.lab import make_cold as _make_cold
    from engine.api import Sampler, generate, random_prompt_ids
    from engine.api import Engine

    budget = parse_size(a.budget)
    eng = Engine(a.model, EngineConfig(ram_budget=budget, ctx_size=512, threads=a.threads, io_mode=a.io_mode))
    m = eng.model
    acc: dict = defaultdict(float)
    layers = {k: defaultdict(float) for k in ("attention", "moe", "layer")}
    # The MoE layer looks route_layer up in its own module's globals, so patch it there.
    moe_globals = type(m)._moe.__globals__
    route_name = "route_layer" if "route_layer" in moe_globals else "route"  # older trees: `route`
    orig_route = moe_globals[route_name]

    def route_timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig_route(*args, **kwargs)
        finally:
            acc["router"] += time.perf_counter() - t0
    moe_globals[route_name] = route_timed
    for name, key in (("_attention", "attention"), ("_moe", "moe"), ("_layer", "layer")):
        _wrap(m, name, acc, key + "_total", layers[key])
    # Newer trees: the fused decode seams (one native call each), beside the unfused ones they replace.
    for name, key in (("_decode_attention", "attention"), ("_resident_moe_call", "moe")):
        if hasattr(m, name):
            _wrap(m, name, acc, key + "_total", layers[key])
    if hasattr(m, "_decode_step"):  # newer trees: the whole step's layers in one native call
        _wrap(m, "_decode_step", acc, "decode_step_total")
        if a.per_layer_calls and hasattr(m, "plan_decode"):  # the route chosen at load, less the whole step
            m.plan_decode(eng.kv, whole_step=False)
        elif not hasattr(m, "plan_decode"):  # older trees: a switch per call
            m.step_loop = not a.per_layer_calls
    _wrap(m, "forward", acc, "step_total")
    prompt = random_prompt_ids(a.prompt_tokens, eng.args.vocab_size, 0)
    generate(eng, prompt, 2, Sampler())  # warm-up: kernels, thread pool, first-touch of KV pages
    if budget:
        _make_cold(eng)
    store = eng.store
    snapshots = []

    def on_token(_token):
        if not snapshots and store is not None and hasattr(store, "reset_stats"):
            store.reset_stats()  # read wait counts decode steps only, like the timers
        snapshots.append((dict(acc), {k: dict(v) for k, v in layers.items()}))

    gen = generate(eng, prompt, a.tokens + 1, Sampler(), on_token=on_token)
    (first, first_l), (last, last_l) = snapshots[0], snapshots[-1]
    n = len(snapshots) - 1  # decode steps after the prefill token
    d = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / n for k in last}
    token_s = sum(gen.token_seconds) / len(gen.token_seconds)  # decode steps only (no prefill)
    stall = (eng.io_stats().get("io_stall_s", 0.0) or 0.0) / len(gen.token_seconds)
    parts = {"layers_one_call": d.get("decode_step_total", 0.0), "attention": d["attention_total"],
             "router": d.get("router", 0.0),
             "experts": d["moe_total"] - d.get("router", 0.0) - stall, "read_wait": stall,
             "layer_rest": d["layer_total"] - d["attention_total"] - d["moe_total"],
             "head": d["step_total"] - d["layer_total"] - d.get("decode_step_total", 0.0), "outside_forward": token_s - d["step_total"]}
    per_layer = []
    for layer in range(eng.args.num_layers):
        delta = {k: (last_l[k].get(layer, 0.0) - first_l[k].get(layer, 0.0)) / n for k in layers}
        per_layer.append({"attention": 1000 * delta["attention"], "moe": 1000 * delta["moe"],
                          "rest": 1000 * (delta["layer"] - delta["attention"] - delta["moe"])})
    out = {"model": a.model, "token_ms": 1000 * token_s, "decode_tok_s": 1 / token_s,
           "threads": torch.get_num_threads(), "parts_ms": {k: 1000 * v for k, v in parts.items()},
           "per_layer_ms": per_layer, "output_ids": gen.output_ids,
           "kernel": getattr(eng, "kernel", None),
           # the route the engine runs, and so the one timed (older trees: None)
           "decode_route": eng.decode_plan.describe() if hasattr(eng, "decode_plan") else None}
    pos = len(prompt) + len(gen.output_ids)
    token = gen.output_ids[-1]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for step in range(a.profile_steps):
            logits = eng.forward([token], pos + step)
            token = int(logits[-1].argmax())
        wall = time.perf_counter() - t0
    out["profile"] = _op_table(prof, wall, a.profile_steps)
    eng.close()
    return out


def run_tree(tree: Path, model: str, a) -> dict:
    # Imported here, in the parent only: the child must import the measured tree's packages.
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import run_in_tree
    return run_in_tree(__file__, tree, ["--model", model, "--tokens", str(a.tokens), "--prompt-tokens",
                                        str(a.prompt_tokens), "--threads", str(a.threads), "--budget", a.budget,
                                        "--io-mode", a.io_mode, "--profile-steps", str(a.profile_steps)]
                       + (["--per-layer-calls"] if a.per_layer_calls else []))


def print_tables(rows: list[dict], a) -> None:
    mode = "resident" if a.budget == "0" else f"cold, budget {a.budget}, {a.io_mode}"
    print(f"decode, {mode}, {a.tokens} decode tokens after a {a.prompt_tokens}-token prompt, {a.threads} threads,"
          f" ms per token\n")
    if a.rounds > 1:
        print_medians(rows)
    print("| model | side | round | tok/s | ms/token | " + " | ".join(PARTS) + " | native ops | torch ops | Python between ops"
          " | top-level ops/step | load |")
    print("|---|---|---|---|---|" + "---|" * len(PARTS) + "---|---|---|---|---|")
    for r in rows:
        p, prof = r["parts_ms"], r["profile"]
        print(f"| {Path(r['model']).name} | {r['side']} | {r['round'] + 1} | {r['decode_tok_s']:.2f} | {r['token_ms']:.2f} | "
              + " | ".join(f"{p[k]:.2f}" for k in PARTS)
              + f" | {prof['native_ms']:.2f} | {prof['torch_ms']:.2f} | {prof['python_ms']:.2f} | {prof['calls']:.0f}"
              f" | {r['load_avg_1m']:.2f} |")
    print("\n(native / torch / Python columns: shares of a profiled step; the profiler's own cost is in them)")
    print("\nper layer, ms per token (attention / MoE / rest), median and max over layers\n")
    print("| model | side | attention med | attention max | MoE med | MoE max | rest med | rest max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cols = []
        for k in ("attention", "moe", "rest"):
            v = [layer[k] for layer in r["per_layer_ms"]]
            cols += [statistics.median(v), max(v)]
        print(f"| {Path(r['model']).name} | {r['side']} | " + " | ".join(f"{c:.3f}" for c in cols) + " |")
    for r in rows:
        prof = r["profile"]
        print(f"\n{Path(r['model']).name} / {r['side']}: top-level operators of one profiled decode step "
              f"({prof['profiled_step_ms']:.2f} ms, {r['threads']} threads; route {r.get('decode_route')})\n")
        print("| operator | kind | calls/step | ms/step |")
        print("|---|---|---|---|")
        for name, calls, ms in prof["ops"][:a.op_rows]:
            print(f"| {name} | {'native' if name.startswith('colibri') else 'torch'} | {calls:.0f} | {ms:.3f} |")
        print(f"| (Python between ops) | python | | {prof['python_ms']:.3f} |")
    by_model = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    for model, sides in by_model.items():
        if len({r["side"] for r in sides}) == 2:
            same = all(r["output_ids"] == sides[0]["output_ids"] for r in sides)
            print(f"\n{Path(model).name}: the two trees produced {'the same' if same else 'different'} tokens")


def print_medians(rows: list[dict]) -> None:
    """Per model and side, the median over rounds (min-max for tok/s) of the unprofiled figures."""
    print("median over rounds (tok/s: min-max)\n")
    print("| model | side | rounds | tok/s | ms/token | " + " | ".join(PARTS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(PARTS))
    groups = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["side"])].append(r)
    for (model, side), rs in groups.items():
        tok = [r["decode_tok_s"] for r in rs]
        parts = [statistics.median(r["parts_ms"][k] for r in rs) for k in PARTS]
        print(f"| {Path(model).name} | {side} | {len(rs)} | {statistics.median(tok):.2f} ({min(tok):.2f}-{max(tok):.2f})"
              f" | {statistics.median(r['token_ms'] for r in rs):.2f} | " + " | ".join(f"{v:.2f}" for v in parts) + " |")
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", action="append",
                    help="model directory or synth preset (repeat for several: bf16, int8, int4; default demo)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", default="0", help="0 = resident; a size = cold streaming under that budget")
    ap.add_argument("--io-mode", default="direct")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--op-rows", type=int, default=14)
    ap.add_argument("--before-src", help="a second tree (the old code) measured in the same run")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the trees alternating (after, before, ...)")
    ap.add_argument("--per-layer-calls", action="store_true",
                    help="keep one native call per attention half and MoE layer (the parts split), not one per step")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.child:
        a.model = a.model[0]  # the parent resolved it to a directory
        json.dump(child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))  # the parent's helpers (see run_tree)
    from benchmarks.trees import alternate_sides
    from engine.api import resolve_model

    # Resolved once here, so every tree measured reads the same synthesized directory.
    models = [str(resolve_model(m)) for m in (a.model or ["demo"])]

    rows = []
    for model in models:
        rows += alternate_sides(ROOT, a.before_src, a.rounds, lambda tree, model=model: run_tree(tree, model, a))
    if a.json:
        from benchmarks.benchkit import emit, run_conditions  # the parent only: the child prints its wire JSON
        emit('decode_profile', rows, run_conditions(a), True, [])
        return 0
    print_tables(rows, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
