"""Streaming decode speed against its roofline bound (issue: stream experts under a budget).

For a handful of configs on `demo` under a 1 GiB budget, cold, each run as a real trial
(`colibri bench` in a subprocess inside a memory cgroup limited to the budget):

    bound s/token = bytes read per decode token / fio bandwidth at (request size, queue depth)
                    + compute s/token of the fully resident run

and the ratio measured tok/s ÷ bound tok/s. The request size is the engine's read request
(min(chunk_size, expert bytes)); the queue depth is io_threads. Bandwidths come from the
probe's fio curve on the model's own filesystem (or --profile FILE).

    .venv/bin/python benchmarks/streaming.py [--model demo] [--budget 1GiB] [--tokens 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig, format_size, parse_size  # noqa: E402
from engine.metrics import git_commit  # noqa: E402
from engine.resolve import resolve_model  # noqa: E402
from engine.runtime import physical_cores  # noqa: E402
from tuner.trial import run_trial  # noqa: E402


def configs(budget: int) -> dict[str, EngineConfig]:
    cores = physical_cores()
    base = EngineConfig(ram_budget=budget, ctx_size=512)
    return {
        "rule of thumb": base.replace(prefetch_depth=2, threads=cores, cpu_cache_ratio=1.0, io_mode="buffered"),
        "direct 1MiB pf1 io4": base.replace(io_mode="direct", chunk_size=1 << 20, prefetch_depth=1, io_threads=4),
        "direct 4MiB pf1 io8": base.replace(io_mode="direct", chunk_size=4 << 20, prefetch_depth=1, io_threads=8),
        "direct 1MiB pf0 io4": base.replace(io_mode="direct", chunk_size=1 << 20, prefetch_depth=0, io_threads=4),
        "direct 1MiB pf2 cache0.6": base.replace(io_mode="direct", prefetch_depth=2, cpu_cache_ratio=0.6),
        "buffered pf1 cache0.6": base.replace(io_mode="buffered", prefetch_depth=1, cpu_cache_ratio=0.6),
        "mmap pf1 cache0.6": base.replace(io_mode="mmap", prefetch_depth=1, cpu_cache_ratio=0.6),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--profile", help="saved hardware profile JSON (default: run a quick probe)")
    ap.add_argument("--only", nargs="*", help="config names to run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from tuner.probe import load_profile, run_probe
    model_dir = resolve_model(a.model)
    budget = parse_size(a.budget)
    profile = load_profile(a.profile) if a.profile else run_probe(str(model_dir), quick=True)

    print(f"# streaming benchmark {time.strftime('%Y-%m-%d')} commit {git_commit()} model {model_dir.name} "
          f"budget {format_size(budget)} cold, {a.tokens} tokens x {a.repeats} repeats, prompt {a.prompt_tokens}",
          file=sys.stderr)
    resident = run_trial(model_dir, EngineConfig(ctx_size=512), tokens=a.tokens, repeats=a.repeats, cold=False,
                         prompt_tokens=a.prompt_tokens, timeout=1800)
    if not resident.ok:
        print(f"resident run failed: {resident.error}", file=sys.stderr)
        return 1
    compute_s = 1.0 / resident.metrics["decode_tok_s"]
    rows = [dict(name="resident (no budget)", tok_s=resident.metrics["decode_tok_s"],
                 spread=resident.metrics["summary"]["decode_tok_s"], bytes_per_token=0, bound_tok_s=1 / compute_s,
                 ratio=1.0, hit=None, stall=None, recall=None, peak=resident.metrics["peak_rss_bytes"],
                 cgroup_peak=None, io="resident")]
    for name, cfg in configs(budget).items():
        if a.only and name not in a.only:
            continue
        print(f"running {name} ...", file=sys.stderr)
        t = run_trial(model_dir, cfg, tokens=a.tokens, repeats=a.repeats, cold=True, prompt_tokens=a.prompt_tokens,
                      limit_bytes=budget, timeout=1800)
        if not t.ok:
            rows.append(dict(name=name, error=f"{t.status}: {t.error}"))
            continue
        m = t.metrics
        expert = m["geometry"]["expert_bytes_on_disk"]
        request = min(cfg.chunk_size, expert)
        bw = profile.read_bandwidth(request, cfg.io_threads, direct=cfg.io_mode == "direct")
        bound_s = m["bytes_read_per_token"] / bw + compute_s
        rows.append(dict(name=name, tok_s=m["decode_tok_s"], spread=m["summary"]["decode_tok_s"],
                         bytes_per_token=m["bytes_read_per_token"], bw=bw, bound_tok_s=1 / bound_s,
                         ratio=m["decode_tok_s"] / (1 / bound_s), hit=(m.get("hit_rate") or {}).get("ram"),
                         stall=m.get("io_stall_fraction"), recall=m.get("lookahead_recall"),
                         peak=m["peak_rss_bytes"], cgroup_peak=t.cgroup_peak_bytes, io=m["io_mode_effective"]))
    if a.json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        return 0
    print("| config | io | decode tok/s (median, min-max) | MiB read/token | fio GB/s at request, QD | bound tok/s "
          "| measured/bound | RAM hit | lookahead recall | I/O stall | peak RSS | cgroup peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | | {r['error']} | | | | | | | | | |")
            continue
        s = r["spread"]
        pct = (lambda v: "-" if v is None else f"{v:.0%}")
        print(f"| {r['name']} | {r['io']} | {r['tok_s']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
              f"{r['bytes_per_token'] / 2**20:.0f} | {r.get('bw', 0) / 1e9:.2f} | {r['bound_tok_s']:.3f} | "
              f"{r['ratio']:.2f} | {pct(r['hit'])} | {pct(r['recall'])} | {pct(r['stall'])} | "
              f"{format_size(r['peak'])} | {format_size(r['cgroup_peak'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
