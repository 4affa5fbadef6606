"""The tuner against an exhaustive grid on geometries it was not developed on, under the steady workload.

    .venv/bin/python benchmarks/tuning/tuner_unseen.py          # both committed geometries, full size
    .venv/bin/python benchmarks/tuning/tuner_unseen.py --geometry engine/presets/tiny.json:400MiB \\
        --trials 4 --seeds 3 --grid-limit 6 --out reports/tuner_unseen_tiny      # a minute: that it works

tuner_quality.py measured the sampler choice on demo, the geometry the tuner was developed on. This
asks the same question where it was not: benchmarks/tuning/geometries/*.json (wide24: 24 layers x
16 experts top-2 at 1.25 GiB, issue 43's; narrow12: 12 layers x 48 experts top-4 at 768 MiB),
each synthesized once into --models. For each:

1. every point of tuner_quality's grid (chunk size x prefetch depth x cache ratio x io mode, 36
   points) is measured once as a real trial (`colibri bench` subprocess in a memory cgroup, cold)
   with the steady workload `colibri tune` uses now (3 prompts, sampled, decoded for a few cache
   cycles sized from the memory plan, the median over prompts; tuner/search/workload.py). Cached
   in --out/<name>/grid.json: a rerun measures only what is missing.
2. the tuner's sampler (GP as `colibri tune` sets it up, the baseline enqueued first) is replayed
   against the measured grid for --seeds seeds of --trials evaluations each.

Prints, per geometry: the grid's best, the tuner's pick as a share of it (median and worst over
seeds), the evaluations spent, and the evaluations it took to reach 95% of the best, through
benchkit's printers: the conditions line and a markdown table, or with --json one colibri.bench/1
document (the progress lines go to stderr). The same document is written to
--out/tuner_unseen.json. --lock FILE holds benchkit.bench_lock around each measured grid point.
Full size is 72 trials of about 10 s each on an NVMe box (several minutes per geometry, plus
synthesizing 4 GB).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions  # noqa: E402
from benchmarks.tuning.tuner_quality import (  # noqa: E402
    BASELINE, all_points, config_of, evaluations_to_reach, key_of, run_tuner)
from engine.api import (ColibriError, atomic_write_text, format_size, load_geometry_file, parse_size,  # noqa: E402
                        synthesize)
from tuner.search.model_facts import ModelFacts  # noqa: E402
from tuner.search.space import DEFAULT_OVERHEAD_BYTES  # noqa: E402
from tuner.search.trial import run_trial, steady_args  # noqa: E402
from tuner.search.workload import STEADY_PROMPTS, steady_tokens  # noqa: E402
from engine.api import STEADY_TEMPERATURE, STEADY_TOP_P  # noqa: E402

TOOL = "tuner_unseen"
HERE = Path(__file__).resolve().parent
GEOMETRIES = (f"{HERE / 'geometries' / 'wide24.json'}:1280MiB", f"{HERE / 'geometries' / 'narrow12.json'}:768MiB")
COLUMNS = [("geometry", lambda r: r["geometry"]), ("budget", lambda r: r["budget"]),
           ("tokens/prompt", lambda r: r["tokens"]), ("grid points", lambda r: r["points"]),
           ("grid best tok/s", lambda r: r["best"]), ("baseline", lambda r: r["baseline"]),
           ("tuner pick (median / worst)", lambda r: f"{r['share_median']:.0%} / {r['share_worst']:.0%}"),
           ("evaluations", lambda r: r["evaluations"]),
           ("to reach 95% (median, seeds)", lambda r: f"{r['reach95_median']} ({r['reach95_seeds']})")]


def measure_grid(model_dir: Path, budget: int, tokens: int, args, cache: Path) -> dict:
    table = json.loads(cache.read_text()).get("table", {}) if cache.is_file() else {}
    points = all_points()
    if args.grid_limit:  # a smoke run: the baseline and the first points only
        points = [BASELINE] + [p for p in points if key_of(p) != key_of(BASELINE)][:args.grid_limit - 1]
    for i, point in enumerate(points, 1):
        k = key_of(point)
        if k in table:
            continue
        config = config_of(point, budget, args.threads, args.ctx)
        with bench_lock(args.lock):
            res = run_trial(model_dir, config, tokens=tokens, repeats=1, cold=True, prompt_tokens=args.prompt_tokens,
                            seed=args.seed, limit_bytes=budget, timeout=args.trial_timeout,
                            extra_args=steady_args(STEADY_PROMPTS, STEADY_TEMPERATURE, STEADY_TOP_P))
        m = res.metrics if res.ok else {}
        table[k] = {"status": res.status, "decode_tok_s": m.get("decode_tok_s") or 0.0,
                    "spread": (m.get("summary") or {}).get("decode_tok_s"), "wall_seconds": round(res.wall_seconds, 2),
                    "degenerate": (m.get("workload") or {}).get("degenerate"), "error": res.error or None}
        print(f"  [{i}/{len(points)}] {k}: {res.status} {table[k]['decode_tok_s']:.3g} tok/s "
              f"({res.wall_seconds:.1f} s)", file=sys.stderr)
        atomic_write_text(cache, json.dumps({"table": table}, indent=1) + "\n")
    return {k: v for k, v in table.items() if k in {key_of(p) for p in points}}


def replay(table: dict, trials: int, seeds: int) -> dict:
    """The tuner's sampler on the measured grid: the pick's share of the best, evaluations spent."""
    full = {key_of(p): table.get(key_of(p), {"status": "missing", "decode_tok_s": 0.0}) for p in all_points()}
    best = max(v["decode_tok_s"] for v in table.values())
    shares, reach = [], []
    for seed in range(seeds):
        seen = run_tuner(full, trials, seed)
        pick = max(full[k]["decode_tok_s"] for k in seen)
        shares.append(pick / best if best else 0.0)
        reach.append(evaluations_to_reach(full, seen, 0.95 * best))
    hit = [r for r in reach if r is not None]
    return {"best": best, "share_median": statistics.median(shares), "share_worst": min(shares),
            "evaluations": trials, "reach95_median": statistics.median(hit) if hit else None,
            "reach95_seeds": f"{len(hit)}/{seeds}"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", action="append", metavar="FILE:BUDGET",
                   help=f"a geometry file and its budget (default: {', '.join(Path(g).name for g in GEOMETRIES)})")
    p.add_argument("--models", default=str(Path.home() / ".cache" / "colibri" / "models"),
                   help="where the geometries are synthesized (once)")
    p.add_argument("--trials", type=int, default=10, help="evaluations per replay (what a short tune spends)")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="decode tokens per prompt (default: sized as tune sizes them)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--trial-timeout", type=float, default=600)
    p.add_argument("--grid-limit", type=int, default=0, help="measure only this many grid points (a smoke run)")
    p.add_argument("--out", default="reports/tuner_unseen")
    add_output_flags(p)
    return p.parse_args(argv)


def geometry_spec(spec: str) -> tuple[dict, int]:
    """FILE:BUDGET as (the geometry, the budget in bytes); a bad one is a ColibriError."""
    path, _, budget_text = spec.rpartition(":")
    if not path:
        raise ColibriError(f"--geometry {spec!r}: expected FILE:BUDGET")
    return load_geometry_file(path), parse_size(budget_text)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # every spec checked before anything is synthesized or measured
        specs = [geometry_spec(spec) for spec in args.geometry or GEOMETRIES]
    except ColibriError as exc:
        return refuse(TOOL, str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for geometry, budget in specs:
        model_dir = Path(args.models) / f"unseen-{geometry['name']}"
        if not (model_dir / "config.json").is_file():
            synthesize(geometry, model_dir, progress=True)
        tokens, cycle = steady_tokens(ModelFacts.read(model_dir), budget, DEFAULT_OVERHEAD_BYTES)
        tokens = args.tokens or tokens
        print(f"{geometry['name']}: {format_size(budget)}, steady workload {STEADY_PROMPTS} prompts x {tokens} "
              f"tokens (cache cycle {cycle} tokens)", file=sys.stderr)
        (out / geometry["name"]).mkdir(exist_ok=True)
        table = measure_grid(model_dir, budget, tokens, args, out / geometry["name"] / "grid.json")
        r = replay(table, args.trials, args.seeds)
        base = table[key_of(BASELINE)]["decode_tok_s"]
        rows.append({"geometry": geometry["name"], "budget": format_size(budget), "tokens": tokens, "cycle": cycle,
                     "points": len(table), "baseline": base, **r})
    cond = run_conditions(args, workload=f"steady: {STEADY_PROMPTS} prompts, temperature {STEADY_TEMPERATURE}, "
                                         f"top-p {STEADY_TOP_P}", cold=True, cgroup_limit="the budget", repeats=1,
                          tuner=f"GP as `colibri tune`, {args.seeds} seeds")
    doc = io.StringIO()
    emit(TOOL, rows, cond, True, COLUMNS, out=doc)
    atomic_write_text(out / "tuner_unseen.json", doc.getvalue())
    emit(TOOL, rows, cond, args.json, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
