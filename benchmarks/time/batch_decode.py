"""Batched decode (engine/arch/decode_rows.py) against one stream, beside the bound of the step's bytes.

    .venv/bin/python benchmarks/time/batch_decode.py --model DIR [--budget 1GiB] [--batch 4,8] \
        [--tokens 128] [--rounds 2] [--profile PROFILE.json] [--threads 2] [--json] [--lock FILE]

Each round runs, in a child process (inside a memory cgroup of --budget, page cache counted, the
engine's budget the same; none with --budget 0: resident), alternating which goes first:
  single   one sequence decoding alone through the engine's usual decode route (Engine.forward,
           one token: the native whole step where it applies), --tokens greedy tokens;
  B        B sequences (prompts of different seeds and lengths) decoding together, one
           Engine.decode_rows step per token, --tokens greedy tokens each.
Under a budget the expert caches are emptied and their pages dropped before each timed part
(cold); resident runs are warm (one unmeasured generation first).

Columns: aggregate tok/s (tokens of every sequence / wall time of the decode steps), per-stream
tok/s, the step's expert bytes read (streamed) and the union of experts per MoE layer per step (a
separate routing-recorded pass: recording turns the fused MoE off, so it is never timed); the
bound: streamed, the step's bytes read at the disk's cold O_DIRECT bandwidth (measured here over
the model's shards, expert-sized requests); resident, the weight bytes a step touches (dense once,
the union of experts once) at the profile's memory bandwidth (--profile; else none).
`x bound` is the bound's step time over the measured one (1.0 = at the bound).

DIR is a demo model (`python -m colibri.cli synth demo -o DIR`). Prompts are seeded random ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOOL = "batch_decode"
MiB = 1 << 20


# --- the child: one round in this process ------------------------------------------------------

def _prompts(B: int, vocab: int, seed: int) -> list[list[int]]:
    import torch
    out = []
    for s in range(B):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        out.append(torch.randint(0, min(1000, vocab), (12 + 3 * s,), generator=g).tolist())
    return out


def _single(engine, prompt: list[int], tokens: int) -> tuple[float, int]:
    """(decode seconds, bytes read) of one greedy sequence through Engine.forward."""
    logits = engine.forward(prompt, 0, last_only=True)
    token, pos = int(logits[-1].argmax()), len(prompt)
    _reset(engine)
    t0 = time.perf_counter()
    for _ in range(tokens):
        token = int(engine.forward([token], pos)[-1].argmax())
        pos += 1
    return time.perf_counter() - t0, engine.io_stats().get("bytes_read", 0)


def _batched(engine, prompts: list[list[int]], tokens: int, kvs: list) -> tuple[float, int]:
    """(decode seconds, bytes read) of len(prompts) greedy sequences, one decode_rows step per token."""
    last = [int(engine.prefill_into(kv, p, 0)[-1].argmax()) for kv, p in zip(kvs, prompts)]
    pos = [len(p) for p in prompts]
    _reset(engine)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = engine.decode_rows(last, pos, kvs)
        last = [int(x) for x in logits.argmax(dim=1).tolist()]
        pos = [p + 1 for p in pos]
    return time.perf_counter() - t0, engine.io_stats().get("bytes_read", 0)


def _reset(engine) -> None:
    store = engine.store
    if store is not None and store.streams:
        store.make_cold()
        store.reset_stats()


def _union_per_step(engine, prompts, tokens: int, kvs: list) -> float:
    """Mean distinct experts per MoE layer per step over a routing-recorded batched pass (untimed)."""
    engine.record_routing()
    _batched(engine, prompts, min(tokens, 16), kvs)
    unions = [len({e for e in ids.flatten().tolist() if e >= 0})
              for calls in engine.model.routing_log or [] for ids in calls if ids.shape[0] == len(prompts)]
    engine.model.record_routing(False)
    return statistics.mean(unions) if unions else 0.0


def child(a) -> dict:
    from engine.api import Engine, EngineConfig, parse_size
    B = a.b
    config = EngineConfig(ram_budget=parse_size(a.budget), ctx_size=a.ctx, threads=a.threads, max_batch=B)
    with Engine(a.model, config) as engine:
        prompts = _prompts(B, engine.args.vocab_size, a.seed)
        kvs = [engine.new_cache() for _ in range(B)]
        streamed = engine.store is not None and engine.store.streams
        if not streamed:  # resident: warm both paths once
            _single(engine, prompts[0], 4)
            _batched(engine, prompts, 4, kvs)
        parts = {}
        order = ("single", "batch") if a.round % 2 == 0 else ("batch", "single")
        for part in order:
            if part == "single":
                parts[part] = _single(engine, prompts[0], a.tokens)
            else:
                parts[part] = _batched(engine, prompts, a.tokens, kvs)
        union = _union_per_step(engine, prompts, a.tokens, kvs)
        layout = engine.layout
        return {"streamed": streamed, "single_s": parts["single"][0], "single_bytes": parts["single"][1],
                "batch_s": parts["batch"][0], "batch_bytes": parts["batch"][1], "union": union,
                "route": engine.decode_plan.route, "moe_layers": sum(engine.args.is_moe_layer(i)
                                                                     for i in range(engine.args.num_layers)),
                "expert_disk_bytes": engine.plan.expert_disk_bytes, "expert_bytes": engine.plan.expert_bytes,
                "dense_bytes": engine.plan.dense_bytes, "top_k": engine.args.top_k,
                "quant": getattr(engine.quant, "quant", None) or str(engine.dtype).replace("torch.", ""),
                "experts_total": layout.num_routed if layout is not None else 0}


def run_child(a, B: int, round_: int) -> dict:
    from benchmarks.benchkit import child_json
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", a.model, "--b", str(B),
            "--round", str(round_), "--ctx", str(a.tokens + 64), "--budget", a.budget, "--threads", str(a.threads),
            "--tokens", str(a.tokens), "--seed", str(a.seed)]
    print(f"{TOOL}: B={B} round {round_ + 1} budget={a.budget} ...", file=sys.stderr, flush=True)
    return child_json(TOOL, argv, a.budget, a.timeout, f"B={B}", REPO)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.benchkit import add_output_flags, add_run_flags
    ap.add_argument("--model", required=True, help="a demo model directory")
    add_run_flags(ap, budget="0", tokens=128, threads=2)  # budget 0: resident, warm
    ap.add_argument("--batch", default="4,8", help="batch sizes (default 4,8)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per batch size, alternating the order (default 2)")
    ap.add_argument("--profile", help="hardware profile JSON: the resident bound's memory bandwidth")
    ap.add_argument("--io-threads", type=int, default=4, help="threads of the bandwidth probe (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    add_output_flags(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--b", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    from benchmarks.benchkit import bench_lock, cold_read_bandwidth, emit, refuse, run_conditions, spread
    if not Path(a.model, "config.json").is_file():
        return refuse(TOOL, f"{a.model}: not a model directory (python -m colibri.cli synth demo -o DIR)")
    try:
        batches = [int(x) for x in a.batch.split(",") if x]
    except ValueError:
        return refuse(TOOL, f"--batch {a.batch!r}: expected comma-separated integers")
    if not batches or min(batches) < 1 or a.tokens < 1 or a.rounds < 1:
        return refuse(TOOL, "--batch values, --tokens and --rounds must be positive")
    mem_bw = None
    if a.profile:
        from tuner.costmodel.hardware import HardwareView
        from tuner.probe.hardware_profile import load_profile
        mem_bw = HardwareView(load_profile(a.profile)).memory_bandwidth(a.threads)
    rows, disk_bw = [], None
    for B in batches:
        runs = []
        for r in range(a.rounds):
            with bench_lock(a.lock):
                runs.append(run_child(a, B, r))
        m = runs[0]
        if m["streamed"] and disk_bw is None:
            print(f"{TOOL}: measuring the cold read bandwidth ...", file=sys.stderr, flush=True)
            disk_bw = cold_read_bandwidth(a.model, -(-m["expert_disk_bytes"] // 4096) * 4096, a.io_threads, 1 << 30)
        single = [a.tokens / x["single_s"] for x in runs]
        agg = [B * a.tokens / x["batch_s"] for x in runs]
        step_s = statistics.median(x["batch_s"] for x in runs) / a.tokens
        union = statistics.median(x["union"] for x in runs)
        bytes_step = statistics.median(x["batch_bytes"] for x in runs) / a.tokens
        single_bytes = statistics.median(x["single_bytes"] for x in runs) / a.tokens
        if m["streamed"]:
            bound_s = bytes_step / disk_bw if disk_bw else None
        else:
            touched = m["dense_bytes"] + m["moe_layers"] * union * m["expert_bytes"]
            bound_s = touched / mem_bw if mem_bw else None
        rows.append({"batch": B, "quant": m["quant"], "streamed": m["streamed"], "route_single": m["route"],
                     "single_tok_s": spread(single), "aggregate_tok_s": spread(agg),
                     "per_stream_tok_s": round(statistics.median(agg) / B, 2),
                     "x_single": round(statistics.median(agg) / statistics.median(single), 2),
                     "union_per_layer": round(union, 2), "top_k": m["top_k"],
                     "read_mib_per_step": round(bytes_step / MiB, 2), "single_read_mib_per_token": round(single_bytes / MiB, 2),
                     "bound_step_s": round(bound_s, 4) if bound_s else None,
                     "x_bound": round(bound_s / step_s, 2) if bound_s else None, "cgroup": m["cgroup"]})
    from benchmarks.benchkit import fmt_spread
    cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
        ("B", "batch"), ("quant", "quant"), ("streamed", "streamed"), ("per stream", "per_stream_tok_s"),
        ("x single", "x_single"), ("union/layer", "union_per_layer"), ("read MiB/step", "read_mib_per_step"),
        ("single MiB/token", "single_read_mib_per_token"), ("bound s/step", "bound_step_s"), ("x bound", "x_bound"),
        ("cgroup", "cgroup"))]
    cols[3:3] = [("single tok/s", lambda r: fmt_spread(r["single_tok_s"])),
                 ("aggregate tok/s", lambda r: fmt_spread(r["aggregate_tok_s"]))]
    notes = {"disk read bandwidth (O_DIRECT, expert-sized requests)": f"{disk_bw / 1e9:.2f} GB/s"} if disk_bw else {}
    if mem_bw:
        notes["memory bandwidth (profile)"] = f"{mem_bw / 1e9:.1f} GB/s"
    emit(TOOL, rows, run_conditions(a, cold=a.budget not in ("0", ""), greedy=True), a.json, cols, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
