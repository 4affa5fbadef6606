"""Cold prefill under a memory budget: pass-wise (before) against layer-major (after), beside its bound.

    .venv/bin/python benchmarks/time/prefill_layer_major.py --model DIR --before-src main \
        [--budget 1GiB] [--prompt-tokens 512,2048,8192] [--groups 0,256] [--repeats 1] [--threads 2] [--json] [--lock FILE]

For each prompt length: each tree's engine (this checkout: layer-major groups, engine/arch/prefill.py;
--before-src, a revision or directory: its own prefill, pass-wise before issue 42) in a child process
inside a memory cgroup of --budget (page cache counted; tuner/sandbox), the engine's budget the same;
the experts' caches emptied and their pages dropped before the timed prefill (cold), io_mode direct.
A row gives the time to first token (the prompt's Engine.forward(last_only=True): every layer,
the last position's logits), the expert bytes read, median over --repeats, and the cgroup's peak
(page cache included). --groups: this tree's run once per prefill group (prefill_chunk; 0, the
default: the engine's own, the largest the budget allows), to set the default beside one sub-chunk.

The bound, per prompt: one read of the distinct expert bytes the prompt routes to (a resident run of
this tree records the routing) at the disk's cold O_DIRECT read bandwidth (measured here over the
model's shards in expert-sized requests on --io-threads threads), overlapped with the resident
prefill compute of the same prompt (warm, this tree): max(read, compute).

DIR is a demo model (`python -m colibri.cli synth demo -o DIR`). The prompt is a seeded random one
of N ids, the same in every child.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if "--child" not in sys.argv:  # a child imports its own tree's engine (its PYTHONPATH), never this one's
    sys.path.insert(0, str(REPO))

TOOL = "prefill_layer_major"
MiB = 1 << 20


# --- the child: one prefill in this process's tree ----------------------------------------------

def child(a) -> dict:
    import torch
    from engine.api import Engine, EngineConfig, parse_size
    config = EngineConfig(ram_budget=parse_size(a.budget), ctx_size=a.ctx, threads=a.threads, io_mode="direct",
                          **({"prefill_chunk": a.group} if a.group else {}))
    with Engine(a.model, config) as engine:
        ids = torch.randint(0, min(1000, engine.args.vocab_size), (a.n,), generator=torch.Generator().manual_seed(a.seed))
        if a.routing:
            engine.record_routing()
        times, reads = [], []
        for _ in range(a.repeats + (1 if a.warm else 0)):
            store = engine.store
            if store is not None and store.streams and not a.warm:
                store.make_cold()
            if store is not None:
                store.reset_stats()
            t0 = time.perf_counter()
            engine.forward(ids, 0, last_only=True)
            times.append(time.perf_counter() - t0)
            reads.append(engine.io_stats().get("bytes_read", 0))
        if a.warm:
            times, reads = times[1:], reads[1:]
        out = {"ttft_s": statistics.median(times), "bytes_read": statistics.median(reads),
               "prefill_group": getattr(engine.plan, "prefill_group", None)}
        if a.routing:
            keys = {(layer, e) for layer, calls in enumerate(engine.model.routing_log or [])
                    for ids_ in calls for e in ids_.flatten().tolist() if e >= 0}
            out["distinct_experts"] = len(keys)
            out["expert_disk_bytes"] = engine.plan.expert_disk_bytes
    return out


def run_child(tree: Path, a, n: int, budget: str, limit: int | None, *, warm=False, routing=False, group=0) -> dict:
    from benchmarks.trees import tree_env
    from tuner.sandbox import run_limited
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", a.model, "--n", str(n),
            "--ctx", str(n + 16), "--budget", budget, "--threads", str(a.threads), "--repeats", str(a.repeats),
            "--seed", str(a.seed)] + (["--warm"] if warm else []) + (["--routing"] if routing else []) \
        + (["--group", str(group)] if group else [])
    print(f"{TOOL}: n={n} budget={budget} warm={warm} tree={tree} ...", file=sys.stderr, flush=True)
    res = run_limited(argv, limit, timeout=a.timeout, env=tree_env(tree), cwd=tree)
    if res.returncode != 0:
        raise SystemExit(f"{TOOL}: child failed in {tree} (n={n}, oom={res.oom_killed}): {res.stderr.strip()[-600:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["cgroup"] = res.limited
    out["peak_bytes"] = res.peak_bytes
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a demo model directory")
    ap.add_argument("--before-src", default="main", help="the pass-wise tree: a revision or directory (default main)")
    ap.add_argument("--budget", default="1GiB", help="engine budget and cgroup limit (default 1GiB)")
    ap.add_argument("--prompt-tokens", default="512,2048,8192")
    ap.add_argument("--groups", default="0", help="this tree's prefill groups, one row each (0: the engine's default)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4, help="threads of the bandwidth probe (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--lock", default=None, help="hold this benchmark lock per measured step")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--routing", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    from benchmarks.benchkit import bench_lock, cold_read_bandwidth, emit, refuse, run_conditions
    from benchmarks.trees import source_tree
    if not Path(a.model, "config.json").is_file():
        return refuse(TOOL, f"{a.model}: not a model directory (python -m colibri.cli synth demo -o DIR)")
    from engine.api import parse_size
    limit = parse_size(a.budget)
    lengths = [int(x) for x in a.prompt_tokens.split(",") if x]
    groups = [int(x) for x in a.groups.split(",") if x]
    rows = []
    with source_tree(a.before_src) as before:
        bw = None
        for n in lengths:
            with bench_lock(a.lock):
                resident = run_child(REPO, a, n, "0", None, warm=True, routing=True)
                if bw is None:  # requests of one expert's bytes, 4 KiB-aligned (what the engine reads)
                    print(f"{TOOL}: measuring the cold read bandwidth ...", file=sys.stderr, flush=True)
                    bw = cold_read_bandwidth(a.model, -(-resident["expert_disk_bytes"] // 4096) * 4096, a.io_threads,
                                        1 << 30)
            distinct = resident["distinct_experts"] * resident["expert_disk_bytes"]
            bound = max(distinct / bw, resident["ttft_s"])
            sides = [("before (pass-wise)", before, 0)] + [
                (f"after (layer-major{', group ' + str(g) if g else ''})", REPO, g) for g in groups]
            for side, tree, group in sides:
                with bench_lock(a.lock):
                    m = run_child(tree, a, n, a.budget, limit, group=group)
                rows.append({"prompt_tokens": n, "side": side, "ttft_s": round(m["ttft_s"], 3),
                             "prefill_tok_s": round(n / m["ttft_s"], 1), "bytes_read_mib": round(m["bytes_read"] / MiB, 1),
                             "distinct_expert_mib": round(distinct / MiB, 1),
                             "read_x_distinct": round(m["bytes_read"] / distinct, 2) if distinct else None,
                             "bound_s": round(bound, 3), "ttft_x_bound": round(m["ttft_s"] / bound, 2),
                             "resident_prefill_s": round(resident["ttft_s"], 3), "group": m.get("prefill_group"),
                             "peak_mib": round(m["peak_bytes"] / MiB) if m.get("peak_bytes") else None,
                             "cgroup": m["cgroup"]})
    cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
        ("prompt", "prompt_tokens"), ("side", "side"), ("TTFT s", "ttft_s"), ("tok/s", "prefill_tok_s"),
        ("read MiB", "bytes_read_mib"), ("distinct MiB", "distinct_expert_mib"), ("read/distinct", "read_x_distinct"),
        ("bound s", "bound_s"), ("TTFT/bound", "ttft_x_bound"), ("group", "group"), ("peak MiB", "peak_mib"),
        ("cgroup", "cgroup"))]
    emit(TOOL, rows, run_conditions(a, io_mode="direct", cold=True, read_gb_s=round(bw / 1e9, 3)), a.json, cols,
         notes={"read bandwidth (O_DIRECT, expert-sized requests)": f"{bw / 1e9:.2f} GB/s"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
