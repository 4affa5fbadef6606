"""bf16 vs int8 vs int4 containers of one model, side by side, in one run.

    python benchmarks/quant_demo.py --model bf16=DIR --model int8=DIR --model int4-g64=DIR [...]
           [--budget 1GiB] [--tokens 8] [--repeats 2] [--rounds 1] [--json]

For each container: on-disk MiB per expert, and two trials (`colibri bench` in a subprocess):
cold decode under a memory cgroup limited to the budget (page cache counts; pages dropped and
caches emptied before each repeat; O_DIRECT 1 MiB reads, prefetch 1, 4 reader threads — the
best streaming config of docs/BENCHMARKS.md), and resident decode (no budget, warm). Reported:
MiB read per decode token, RAM hit rate, tok/s median (min-max), and the ratio to the first
model (the bf16 baseline). With --rounds R the containers are measured in R interleaved rounds
(the figures are then the medians over all repeats of all rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.base.config import EngineConfig, format_size, parse_size  # noqa: E402
from engine.run.metrics import git_commit  # noqa: E402
from tuner.search.trial import run_trial  # noqa: E402


def _decode(trial) -> list[float]:
    return [r["decode_tok_s"] for r in trial.metrics.get("runs", []) if r.get("decode_tok_s")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-resident", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    models = dict(m.split("=", 1) for m in a.model)
    budget = parse_size(a.budget)
    cold_cfg = EngineConfig(ram_budget=budget, ctx_size=512, io_mode="direct", chunk_size=1 << 20, prefetch_depth=1,
                            io_threads=4, threads=a.threads)
    warm_cfg = EngineConfig(ram_budget=0, ctx_size=512, threads=a.threads)
    rows = {label: {"cold": [], "resident": [], "cold_trials": [], "resident_trials": []} for label in models}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for rnd in range(a.rounds):
        for mode, cfg, cold, limit in (("cold", cold_cfg, True, budget), ("resident", warm_cfg, False, None)):
            if mode == "resident" and a.skip_resident:
                continue
            for label, d in models.items():
                trial = run_trial(d, cfg, tokens=a.tokens, repeats=a.repeats, cold=cold, prompt_tokens=a.prompt_tokens,
                                  limit_bytes=limit, timeout=900)
                if not trial.ok:
                    print(f"{label} {mode}: {trial.status}: {trial.error}", file=sys.stderr)
                    continue
                rows[label][mode] += _decode(trial)
                rows[label][mode + "_trials"].append(trial.metrics | {"cgroup_peak": trial.cgroup_peak_bytes})
                print(f"round {rnd + 1} {label} {mode}: {statistics.median(_decode(trial)):.3f} tok/s", file=sys.stderr)
    table = []
    base = {}
    for label, r in rows.items():
        ct = r["cold_trials"][-1] if r["cold_trials"] else {}
        rt = r["resident_trials"][-1] if r["resident_trials"] else {}
        geo = (ct or rt).get("geometry", {})
        row = {"label": label, "path": models[label], "quant": (ct or rt).get("quant"), "kernel": (ct or rt).get("kernel"),
               "mib_per_expert": geo.get("expert_bytes_on_disk", 0) / 2**20,
               "cache_slots": (ct.get("plan") or {}).get("cache_slots"),
               "mib_read_per_token": statistics.median([t["bytes_read_per_token"] for t in r["cold_trials"]]) / 2**20
               if r["cold_trials"] else None,
               "ram_hit": statistics.median([t["hit_rate"].get("ram") or 0 for t in r["cold_trials"]])
               if r["cold_trials"] else None,
               "cgroup_peak": max((t["cgroup_peak"] or 0 for t in r["cold_trials"]), default=None)}
        for mode in ("cold", "resident"):
            v = r[mode]
            row[mode] = {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} if v else None
            if row[mode] and not base.get(mode):
                base[mode] = row[mode]["median"]
            row[mode + "_x"] = row[mode]["median"] / base[mode] if row[mode] and base.get(mode) else None
        table.append(row)
    out = {"started": started, "commit": git_commit(), "budget": budget, "tokens": a.tokens, "repeats": a.repeats,
           "rounds": a.rounds, "prompt_tokens": a.prompt_tokens, "threads": a.threads,
           "cold_config": cold_cfg.to_dict(), "rows": table}
    if a.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    f = lambda s: "-" if not s else f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"  # noqa: E731
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    print(f"{started}, commit {out['commit']}: cold = {format_size(budget)} cgroup, direct 1MiB, prefetch 1, "
          f"io_threads 4; resident = no budget, warm; {a.threads} threads, prompt {a.prompt_tokens}, "
          f"{a.tokens} tokens x {a.repeats} repeats x {a.rounds} round(s), median (min-max)")
    print("| container | kernel | MiB/expert | cache slots | MiB read/token | RAM hit | cold tok/s | cold vs first "
          "| resident tok/s | resident vs first | cgroup peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        read = "-" if r["mib_read_per_token"] is None else f"{r['mib_read_per_token']:.1f}"
        hit = "-" if r["ram_hit"] is None else f"{r['ram_hit']:.0%}"
        peak = format_size(r["cgroup_peak"]) if r["cgroup_peak"] else "-"
        print(f"| {r['label']} | {r['kernel']} | {r['mib_per_expert']:.3f} | {r['cache_slots']} | {read} | {hit} | "
              f"{f(r['cold'])} | {x(r['cold_x'])} | {f(r['resident'])} | {x(r['resident_x'])} | {peak} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
