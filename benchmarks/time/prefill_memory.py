"""Peak resident memory of a long prefill: one pass over the whole prompt against the engine's passes.

    python benchmarks/time/prefill_memory.py --model DIR --ram-budget 400MiB --tokens 2000 [--whole] [--json]

Loads the model under the budget (ctx 4096), samples the process's RSS every 2 ms while a random
prompt of --tokens tokens is prefilled, and prints the RSS after load, the peak, and the plan's
parts (overhead, prefill charge, expert cache). Default: Engine.forward, in the plan's passes
(engine/movement/plan.py PREFILL_CHUNK, with engine/base/heap.py's releases); --whole: one pass
over the whole prompt (the model's forward directly, as the engine prefilled before). Memory
only (not timed): a run under `quiet test` is fine. Set ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 in
the environment to see oneDNN's default cache.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: engine, benchmarks

import psutil  # noqa: E402
import torch  # noqa: E402

from engine.api import Engine, EngineConfig, parse_size  # noqa: E402
from benchmarks.benchkit import emit, run_conditions  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ram-budget", default="400MiB")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    proc = psutil.Process()
    engine = Engine(args.model, EngineConfig(ram_budget=parse_size(args.ram_budget), ctx_size=4096))
    loaded = proc.memory_info().rss
    peak, done = [loaded], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    ids = torch.randint(0, engine.args.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    if args.whole:
        engine.model.forward(ids, 0, engine.kv, last_only=True)
    else:
        engine.forward(ids, 0, last_only=True)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    plan = engine.plan
    row = {"tokens": args.tokens, "passes": "whole" if args.whole else "chunked", "rss_loaded_mib": loaded >> 20,
           "rss_peak_mib": peak[0] >> 20, "plan_overhead_mib": plan.overhead_bytes >> 20,
           "plan_prefill_mib": round(plan.prefill_bytes / 2**20, 1), "plan_cache_mib": round(plan.cache_bytes / 2**20, 1),
           "budget_mib": plan.budget >> 20, "prefill_s": round(seconds, 1)}
    if args.json:
        emit("prefill_memory", [row], run_conditions(args), True, [])
    else:
        print("| " + " | ".join(row) + " |\n|" + "---|" * len(row) + "\n| " + " | ".join(map(str, row.values())) + " |")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
