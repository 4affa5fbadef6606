"""Does tuning for the user's workload matter? Each tune run's recommendation measured on each workload.

    python benchmarks/workload_cross.py --model DIR --prompts FILE RUN_DIR [RUN_DIR ...] [--repeats 3] [--json]

Every RUN_DIR is a finished `colibri tune` run (its recommended.toml); typically one tuned with
the default decode objective on the fixed prompt, one with `--prompts FILE --objective ttft`.
Each recommendation (and the engine's defaults under the same budget) runs `colibri bench` on
two workloads: the fixed one (8-token random prompt, 8 decoded tokens, what `tune` measures by
default) and FILE's requests; cold, in a memory cgroup of the budget, `--repeats` runs each,
medians. The table gives decode tok/s for the fixed workload and TTFT / request latency for
FILE's, so a recommendation's rank on each shows whether the objectives pick differently, and
the config columns say how the picks differ.

Timed: run it under `quiet bench` (or give --lock FILE to take benchmarks/benchkit.py's lock
per measured run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import bench_lock  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KNOBS = ("chunk_size", "prefetch_depth", "cpu_cache_ratio", "threads", "ctx_size", "io_mode", "io_threads",
         "cache_policy")


def bench(model: str, config: Path | None, budget: int, ctx: int, workload: list[str], repeats: int,
          lock: str | None) -> dict:
    """One recommendation as its run wrote it (its own ctx_size: the memory plan's split depends
    on it), or the engine's defaults under the budget at the largest context any run chose."""
    cmd = [sys.executable, "-m", "tuner.cli", "bench", "--model", model, "--json", "--cold", "--repeats", str(repeats),
           "--cgroup-limit", str(budget), *workload]
    cmd += ["--config", str(config)] if config else ["--ram-budget", str(budget), "--ctx-size", str(ctx)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with bench_lock(lock):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    out = json.loads(proc.stdout)  # the medians over the repeats, at the top level
    return {k: out.get(k) for k in ("decode_tok_s", "ttft_s", "request_s")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--repeats", type=int, default=3)
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
    fixed = ["--prompt-tokens", "8", "--tokens", "8"]
    mine = ["--prompts", args.prompts]
    rows = []
    for name, toml, engine in configs:
        row = {"config": name, **{k: engine.get(k) for k in KNOBS},
               "fixed": bench(args.model, toml, budget, ctx, fixed, args.repeats, args.lock),
               "prompts": bench(args.model, toml, budget, ctx, mine, args.repeats, args.lock)}
        rows.append(row)
        print(f"workload_cross: {name}: {row['fixed']} | {row['prompts']}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = ("config", *KNOBS, "fixed: decode tok/s", "prompts: TTFT s", "prompts: request s", "prompts: decode tok/s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        knobs = [str(r[k]) if r[k] is not None else "default" for k in KNOBS]
        print("| " + " | ".join([r["config"], *knobs, r["fixed"].get("error") or f(r["fixed"].get("decode_tok_s"), ".2f"),
                                 r["prompts"].get("error") or f(r["prompts"].get("ttft_s"), ".2f"),
                                 f(r["prompts"].get("request_s"), ".2f"), f(r["prompts"].get("decode_tok_s"), ".2f")])
              + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
