"""A request trace replayed through serve's scheduler at several batch sizes: goodput, latency tails, throughput.

    .venv/bin/python benchmarks/serving/trace_goodput.py --model DIR [--trace FILE] [--batch 1,2,4,8] \
        [--slo-ttft 2] [--slo-tpot 0.25] [--budget 1GiB] [--rounds 2] [--json] [--lock FILE]

Each round runs `colibri bench --trace FILE --max-batch B` once per batch size (alternating the
order from round to round, so leftover warm state favours neither end), each in its own process:
under --budget inside a memory cgroup of that size (page cache counted), cold (caches emptied
and the model's pages dropped before the replay); with --budget 0 resident. The replay submits
each request when its `at` has come (engine/run/trace_replay.py), greedily.

Columns (medians over rounds, min-max): goodput (requests within --slo-ttft and --slo-tpot per
second of the makespan), requests within the SLOs, p50/p95 TTFT (first token - arrival), p50/p95
TPOT, p95 queue wait, aggregate tok/s (every generated token over the makespan), the mean batch
of the decode steps. The default trace is benchmarks/serving/traces/chat_burst.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import benchkit  # noqa: E402

TOOL = "trace_goodput"
TRACE = REPO / "benchmarks" / "serving" / "traces" / "chat_burst.jsonl"
FIGURES = ("goodput_rps", "slo_met", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "queue_wait_p95_s",
           "aggregate_tok_s", "batch_mean")


def bench(a, batch: int) -> dict:
    argv = [sys.executable, "-m", "colibri.cli", "bench", "--model", a.model, "--trace", a.trace,
            "--max-batch", str(batch), "--slo-ttft", str(a.slo_ttft), "--slo-tpot", str(a.slo_tpot),
            "--repeats", "1", "--threads", str(a.threads), "--json"]
    if a.budget != "0":
        argv += ["--ram-budget", a.budget, "--cgroup-limit", a.budget, "--cold"]
    else:
        argv += ["--warm"]
    with benchkit.bench_lock(a.lock):
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        lines = (out.stderr.strip().splitlines() or ["no output"])
        raise SystemExit(benchkit.refuse(TOOL, f"bench --max-batch {batch}: {lines[-1]}"))
    return json.loads(out.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory or synth preset")
    p.add_argument("--trace", default=str(TRACE), help="request trace (JSON Lines; default chat_burst.jsonl)")
    p.add_argument("--batch", default="1,2,4,8", help="max_batch values, comma-separated (default 1,2,4,8)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds to the first token (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="seconds per token after the first (default 0.25)")
    p.add_argument("--budget", default="1GiB", help="memory budget and cgroup limit, cold; 0: resident, warm")
    p.add_argument("--rounds", type=int, default=2, help="rounds, alternating the order (default 2)")
    p.add_argument("--threads", type=int, default=0, help="compute threads (default 0: physical cores)")
    benchkit.add_output_flags(p)
    a = p.parse_args(argv)
    try:
        batches = [int(b) for b in a.batch.split(",") if b.strip()]
    except ValueError:
        return benchkit.refuse(TOOL, f"--batch {a.batch!r}: comma-separated integers")
    if not batches or any(b < 1 for b in batches) or a.rounds < 1:
        return benchkit.refuse(TOOL, "--batch needs positive integers and --rounds at least 1")
    runs: dict[int, list[dict]] = {b: [] for b in batches}
    for r in range(a.rounds):
        for b in (batches if r % 2 == 0 else batches[::-1]):
            m = bench(a, b)
            runs[b].append(m)
            print(f"round {r + 1}: max_batch {b}: goodput {m.get('goodput_rps')} req/s", file=sys.stderr)
    rows = []
    for b in batches:
        first = runs[b][0]
        rows.append({"max_batch": b, "requests": first["trace"]["requests"],
                     **{k: benchkit.spread(m.get(k) for m in runs[b]) for k in FIGURES}})
    med = lambda k, d=3: (lambda row: benchkit.fmt_spread(row[k], d))  # noqa: E731
    columns = [("max_batch", lambda row: row["max_batch"]), ("goodput req/s", med("goodput_rps")),
               ("within SLOs", lambda row: f"{(row['slo_met'] or {}).get('median', '-')} of {row['requests']}"),
               ("TTFT p50 s", med("ttft_p50_s")), ("TTFT p95 s", med("ttft_p95_s")),
               ("TPOT p50 s", med("tpot_p50_s")), ("TPOT p95 s", med("tpot_p95_s")),
               ("wait p95 s", med("queue_wait_p95_s")), ("aggregate tok/s", med("aggregate_tok_s", 1)),
               ("mean batch", med("batch_mean", 2))]
    cond = benchkit.run_conditions(a, trace_sha256=runs[batches[0]][0]["trace"]["sha256"])
    benchkit.emit(TOOL, rows, cond, a.json, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
