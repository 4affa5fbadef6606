"""Does tuning for the user's workload matter? Each tune run's recommendation measured on each workload.

    python benchmarks/tuning/workload_cross.py --model DIR --prompts FILE RUN_DIR [RUN_DIR ...] [--repeats 3]
        [--tokens 8] [--json]

Every RUN_DIR is a finished `colibri tune` run (its recommended.toml); typically one tuned with
the default decode objective on the fixed prompt, one with `--prompts FILE --objective ttft`.
Each recommendation (and the engine's defaults under the same budget) runs `colibri bench` on
two workloads: the fixed one (8-token random prompt, `--tokens` decoded tokens: 8 is what `tune`
measures by default; give the decode tune's own --tokens) and FILE's requests; cold, in a memory
cgroup of the budget, `--repeats` runs each, medians (min..max). The table gives decode tok/s
for the fixed workload and TTFT / request latency for FILE's, so a recommendation's rank on each
shows whether the objectives pick differently, and the config columns say how the picks differ.
The "why" columns: per decode token of the fixed workload, MiB read and the RAM hit rate; per
request of FILE's, its prefill passes (each prompt in passes of the config's `prefill_chunk`,
every pass routing its own tokens), MiB read and the hit rate.

Timed: run it under `quiet bench` (or give --lock FILE to take benchmarks/benchkit.py's lock
per measured run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import math
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: engine, benchmarks
from benchmarks.benchkit import bench_lock, emit, run_conditions  # noqa: E402
from engine.api import PREFILL_CHUNK  # noqa: E402  (the defaults' pass)

ROOT = Path(__file__).resolve().parents[2]
KNOBS = ("chunk_size", "prefetch_depth", "cpu_cache_ratio", "threads", "ctx_size", "io_mode", "io_threads",
         "cache_policy", "prefill_chunk")
MiB = 1 << 20


def bench(model: str, config: Path | None, budget: int, ctx: int, workload: list[str], repeats: int,
          lock: str | None) -> dict:
    """One recommendation as its run wrote it (its own ctx_size: the memory plan's split depends
    on it), or the engine's defaults under the budget at the largest context any run chose."""
    cmd = [sys.executable, "-m", "colibri.cli", "bench", "--model", model, "--json", "--cold", "--repeats", str(repeats),
           "--cgroup-limit", str(budget), *workload]
    cmd += ["--config", str(config)] if config else ["--ram-budget", str(budget), "--ctx-size", str(ctx)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with bench_lock(lock):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    out = json.loads(proc.stdout)  # the medians over the repeats, at the top level
    row = {k: out.get(k) for k in ("decode_tok_s", "ttft_s", "request_s", "bytes_read_per_token")}
    hit = out.get("hit_rate")  # per tier ({"ram": ..}); the RAM cache's is the one a CPU box has
    row["hit_rate"] = hit.get("ram") if isinstance(hit, dict) else hit
    for k in ("decode_tok_s", "ttft_s", "request_s"):  # the spread over the repeats beside each median
        sp = (out.get("summary") or {}).get(k) or {}
        row[f"{k}_range"] = [sp.get("min"), sp.get("max")]
    runs = out.get("runs") or []
    per_request = sorted(r.get("bytes_read", 0) / max(r.get("requests") or 1, 1) for r in runs)
    row["bytes_read_per_request"] = per_request[len(per_request) // 2] if per_request else None
    return row


def prefill_passes(model: str, prompts: str, chunk: int) -> int:
    """Forward passes FILE's prompts take in passes of at most `chunk` tokens (engine/run/runtime.py)."""
    from engine.api import load_tokenizer
    from engine.api import resolve_model
    from engine.api import load_workload
    requests = load_workload(prompts, load_tokenizer(resolve_model(model)), 8)
    return sum(math.ceil(len(r.prompt_ids) / chunk) for r in requests)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="decode tokens of the fixed workload")
    ap.add_argument("--lock")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs: list[tuple[str, Path | None, dict]] = []
    budget = ctx = None
    for run in args.runs:
        toml = run / "recommended.toml"
        if not toml.is_file():
            print(f"workload_cross: {run}: no recommended.toml (not a finished tune run)", file=sys.stderr)
            return 2
        engine = tomllib.loads(toml.read_text())["engine"]
        budget = budget or engine["ram_budget"]
        ctx = max(ctx or 0, engine["ctx_size"])
        result = json.loads((run / "result.json").read_text())
        configs.append((f"{run.name} ({result.get('objective')})", toml, engine))
    configs.append(("engine defaults", None, {}))
    fixed = ["--prompt-tokens", "8", "--tokens", str(args.tokens)]
    mine = ["--prompts", args.prompts]
    rows = []
    for name, toml, engine in configs:
        row = {"config": name, **{k: engine.get(k) for k in KNOBS},
               "fixed": bench(args.model, toml, budget, ctx, fixed, args.repeats, args.lock),
               "prompts": bench(args.model, toml, budget, ctx, mine, args.repeats, args.lock)}
        row["prefill_passes"] = prefill_passes(args.model, args.prompts, engine.get("prefill_chunk") or PREFILL_CHUNK)
        rows.append(row)
        print(f"workload_cross: {name}: {row['fixed']} | {row['prompts']}", file=sys.stderr)
    if args.json:
        emit("workload_cross", rows, run_conditions(args), True, [])
        return 0
    head = ("config", *KNOBS, "fixed: decode tok/s", "fixed: MiB/token", "fixed: hit rate", "prompts: TTFT s",
            "prompts: request s", "prompts: prefill passes", "prompts: MiB/request", "prompts: hit rate")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731

    def ranged(d, k, spec):
        lo, hi = d.get(f"{k}_range") or (None, None)
        return f(d.get(k), spec) + (f" ({f(lo, spec)}..{f(hi, spec)})" if lo is not None and hi is not None else "")
    for r in rows:
        knobs = [str(r[k]) if r[k] is not None else "default" for k in KNOBS]
        fx, pr = r["fixed"], r["prompts"]
        mib = lambda v: None if v is None else v / MiB  # noqa: E731
        print("| " + " | ".join([r["config"], *knobs, fx.get("error") or ranged(fx, "decode_tok_s", ".3g"),
                                 f(mib(fx.get("bytes_read_per_token")), ".1f"), f(fx.get("hit_rate"), ".2f"),
                                 pr.get("error") or ranged(pr, "ttft_s", ".3f"), ranged(pr, "request_s", ".3f"),
                                 str(r["prefill_passes"]), f(mib(pr.get("bytes_read_per_request")), ".1f"),
                                 f(pr.get("hit_rate"), ".2f")]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
