"""How close does each search method get to the best configuration, at the same trial budget?

    .venv/bin/python benchmarks/tuning/tuner_quality.py                  # demo preset, 1 GiB budget
    .venv/bin/python benchmarks/tuning/tuner_quality.py --trials 10 --seeds 20 --tokens 8 --repeats 2

1. Exhaustive grid over a reduced space (chunk size x prefetch depth x cache ratio x io mode, the
   other knobs at the baseline's values): every point measured once as a real trial (`colibri
   bench` subprocess in a memory cgroup, cold). Measurements are cached in --out/grid.json, so a
   rerun only measures what is missing.
2. Each method searches that same space with --trials evaluations, replayed against the measured
   grid (a tabular benchmark: a method's evaluation of a point returns that point's grid figure),
   for --seeds seeds:
     - tuner : Optuna GPSampler as `colibri tune` configures it (3 start-up points, baseline first)
     - tuner-tpe: multivariate TPE (6 start-up points), the other candidate of the sampler choice
     - random: uniform random points, no repeats
     - greedy: coordinate descent from the baseline, one knob at a time, a change kept only if it
               is >= 3% better than the current winner (Colibrì's own `tune`)
   reporting the grid figure of each method's pick relative to the grid's best, over seeds.
3. Confirmation: the seed-0 pick of each method, the grid's best and the baseline are measured
   again, interleaved (--confirm-rounds rounds), and the medians are compared: the grid's own best
   is also a noisy pick, and this says how much of the ranking survives re-measurement.

Prints tables; writes --out/tuner_quality.json. Figures state their conditions (model, budget,
cold, tokens, repeats, cgroup).

--json: the report's product stays tuner_quality.json; stdout then carries one colibri.bench/1
document (benchkit.emit) over the same figures: a row per method of the replay table, the grid,
the reach and confirmation figures as notes; the text tables and progress go to stderr.
--lock FILE holds benchkit.bench_lock around each measured trial (grid points, confirmation runs).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from engine.api import EngineConfig, atomic_write_text, format_size, parse_size, resolve_model  # noqa: E402
from tuner.search.trial import run_trial  # noqa: E402
from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions  # noqa: E402

TOOL = "tuner_quality"

MiB = 1 << 20
GRID = {
    "chunk_size": [256 * 1024, 1 * MiB, 4 * MiB],
    "prefetch_depth": [0, 2, 4],
    "cpu_cache_ratio": [0.5, 1.0],
    "io_mode": ["direct", "buffered"],
}
BASELINE = {"chunk_size": 1 * MiB, "prefetch_depth": 2, "cpu_cache_ratio": 1.0, "io_mode": "buffered"}
GREEDY_GAIN = 0.03


def key_of(point: dict) -> str:
    return json.dumps({k: point[k] for k in GRID}, sort_keys=True)


def all_points() -> list[dict]:
    names = list(GRID)
    return [dict(zip(names, values)) for values in itertools.product(*(GRID[n] for n in names))]


def config_of(point: dict, budget: int, threads: int, ctx: int) -> EngineConfig:
    return EngineConfig(ram_budget=budget, threads=threads, ctx_size=ctx, io_threads=4, cache_policy="lru", **point)


def measure(model_dir, config: EngineConfig, args) -> dict:
    res = run_trial(model_dir, config, tokens=args.tokens, repeats=args.repeats, cold=True,
                    prompt_tokens=args.prompt_tokens, seed=args.seed, limit_bytes=config.ram_budget,
                    timeout=args.trial_timeout)
    out = {"status": res.status, "wall_seconds": round(res.wall_seconds, 2), "cgroup_limited": res.cgroup_limited}
    if res.ok:
        m = res.metrics
        out.update(decode_tok_s=m.get("decode_tok_s") or 0.0, ttft_s=m.get("ttft_s"),
                   samples=[r.get("decode_tok_s") for r in m.get("runs", [])], hit_rate=(m.get("hit_rate") or {}).get("ram"))
    else:
        out.update(decode_tok_s=0.0, error=res.error)
    return out


# --- search methods, replayed against the measured grid ------------------------------------

def run_tuner(table: dict, trials: int, seed: int, sampler: str = "gp") -> list[str]:
    """The sampler as `colibri tune` sets it up (GP, 3 start-up points, baseline enqueued first),
    or TPE as it is set up for --objective both: the two candidates of the sampler choice."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if sampler == "gp":
        chosen = optuna.samplers.GPSampler(seed=seed, n_startup_trials=3)
    else:
        chosen = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=6)
    study = optuna.create_study(direction="maximize", sampler=chosen)
    study.enqueue_trial(BASELINE)
    seen = []
    for _ in range(trials):
        t = study.ask()
        point = {n: t.suggest_categorical(n, GRID[n]) for n in GRID}
        k = key_of(point)
        seen.append(k)
        value = table[k]["decode_tok_s"]
        t.set_constraint("violation", 0.0 if table[k]["status"] == "ok" else 0.05)
        study.tell(t, value)
    return seen


def run_tuner_model(table: dict, trials: int, seed: int, predicted: dict, warm_starts: int = 3) -> list[str]:
    """`colibri tune` with the cost model: points predicted not to fit are never run (the sampler
    is told they are infeasible, no evaluation spent); the baseline first and then the top
    predicted points are enqueued, in the order `colibri tune` enqueues them, then the GP sampler
    as without the model."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.GPSampler(seed=seed, n_startup_trials=3))
    ranked = sorted((k for k, v in predicted.items() if v is not None), key=lambda k: -predicted[k])
    study.enqueue_trial(BASELINE)
    for k in [k for k in ranked if k != key_of(BASELINE)][:warm_starts]:
        study.enqueue_trial(json.loads(k))
    seen: list[str] = []
    for _ in range(trials * 4):  # asks; refused points cost no evaluation
        if len(seen) >= trials:
            break
        t = study.ask()
        point = {n: t.suggest_categorical(n, GRID[n]) for n in GRID}
        k = key_of(point)
        if predicted.get(k) is None:  # predicted not to fit: never run
            t.set_constraint("violation", 0.05)
            study.tell(t, 0.0)
            continue
        seen.append(k)
        t.set_constraint("violation", 0.0 if table[k]["status"] == "ok" else 0.05)
        study.tell(t, table[k]["decode_tok_s"])
    return seen


def predict_grid(model_dir, profile_path: str, budget: int, threads: int, ctx: int, args) -> dict:
    """Cost-model decode tok/s of every grid point (None: predicted not to fit), with the factors
    the profile carries and the grid's own measurement conditions."""
    from tuner.costmodel.fit import factors_from_profile
    from tuner.costmodel.plan_command import DEFAULT_OVERHEAD_BYTES, make_routing
    from tuner.costmodel.model_geometry import resolve
    from tuner.costmodel.hardware import HardwareView
    from tuner.costmodel.predict import Factors, RunConditions, predict
    from tuner.probe.hardware_profile import load_profile
    profile = load_profile(profile_path)
    factors = factors_from_profile(profile) or Factors()
    overhead = int((profile.cost_model or {}).get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES)
    geometry = resolve(str(model_dir))
    hw = HardwareView(profile)
    routing = make_routing("auto", geometry)
    run = RunConditions(prompt_tokens=args.prompt_tokens, tokens=args.tokens, repeats=args.repeats, cold=True)
    out = {}
    for point in all_points():
        p = predict(geometry, geometry.native_quant, config_of(point, budget, threads, ctx), hw, routing, factors, run,
                    overhead)
        out[key_of(point)] = p.decode_tok_s if p.fits else None
    return out


def evaluations_to_reach(table: dict, seen: list[str], target: float) -> int | None:
    """1-based index of the first evaluation at or above `target`, None if never."""
    return next((i + 1 for i, k in enumerate(seen) if table[k]["decode_tok_s"] >= target), None)


def run_random(table: dict, trials: int, seed: int) -> list[str]:
    keys = sorted(table)
    random.Random(seed).shuffle(keys)
    return keys[:trials]


def run_greedy(table: dict, trials: int, seed: int) -> list[str]:
    """Coordinate descent from the baseline; knob order shuffled by the seed (the only randomness)."""
    current = dict(BASELINE)
    seen = [key_of(current)]
    best = table[seen[0]]["decode_tok_s"]
    knobs = list(GRID)
    random.Random(seed).shuffle(knobs)
    for knob in knobs:
        for value in GRID[knob]:
            if value == current[knob] or len(seen) >= trials:
                continue
            cand = dict(current, **{knob: value})
            k = key_of(cand)
            if k in seen:
                continue
            seen.append(k)
            v = table[k]["decode_tok_s"]
            if v >= best * (1 + GREEDY_GAIN):
                current, best = cand, v
    return seen


def run_tuner_tpe(table: dict, trials: int, seed: int) -> list[str]:
    return run_tuner(table, trials, seed, sampler="tpe")


METHODS = {"tuner": run_tuner, "tuner-tpe": run_tuner_tpe, "random": run_random, "greedy": run_greedy}


def reach_table(table: dict, predicted: dict, top: float, args) -> dict:
    """Evaluations each method needs to reach 95% of the grid's best, over seeds."""
    from scipy.stats import spearmanr
    keys = [k for k in table if predicted.get(k) is not None and table[k]["status"] == "ok"]
    rho = spearmanr([predicted[k] for k in keys], [table[k]["decode_tok_s"] for k in keys]).statistic
    dropped = [k for k in table if predicted.get(k) is None]
    target = 0.95 * top
    methods = {"tuner": lambda s: run_tuner(table, args.reach_budget, s),
               "tuner+model": lambda s: run_tuner_model(table, args.reach_budget, s, predicted),
               "random": lambda s: run_random(table, args.reach_budget, s)}
    out = {"target_tok_s": target, "budget": args.reach_budget, "spearman_predicted_vs_grid": float(rho),
           "prefilter_dropped": dropped,
           "prefilter_dropped_feasible": [k for k in dropped if table[k]["status"] == "ok"]}
    print(f"\nEvaluations to reach 95% of the grid's best ({target:.3f} tok/s), at most {args.reach_budget}, "
          f"{args.seeds} seeds; cost model vs grid: Spearman {rho:.2f}, pre-filter dropped {len(dropped)} point(s), "
          f"{len(out['prefilter_dropped_feasible'])} of them feasible:")
    print(f"  {'method':12} {'median':>7} {'mean':>7} {'worst':>7} {'reached':>8}")
    for name, method in methods.items():
        counts = [evaluations_to_reach(table, method(seed), target) for seed in range(args.seeds)]
        got = [c for c in counts if c is not None]
        # Not reached within the budget counts as budget + 1 (a lower bound on the truth).
        filled = [c if c is not None else args.reach_budget + 1 for c in counts]
        out[name] = {"median": statistics.median(filled), "mean": statistics.fmean(filled), "worst": max(filled),
                     "reached": len(got), "seeds": args.seeds, "counts": counts}
        print(f"  {name:12} {out[name]['median']:7.1f} {out[name]['mean']:7.1f} {out[name]['worst']:7d} "
              f"{len(got):>4}/{args.seeds}")
    return out


def best_of(table: dict, keys: list[str]) -> str:
    return max(keys, key=lambda k: table[k]["decode_tok_s"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--ram-budget", default="1GiB")
    p.add_argument("--trials", type=int, default=10, help="evaluations per method")
    p.add_argument("--seeds", type=int, default=20, help="replays per method")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--min-ctx", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--trial-timeout", type=float, default=600)
    p.add_argument("--confirm-rounds", type=int, default=2)
    p.add_argument("--out", default="reports/tuner_quality")
    p.add_argument("--profile", help="calibrated profile: also replay the tuner with the cost model "
                                     "(pre-filter + warm starts) and count evaluations to 95%% of the grid's best")
    p.add_argument("--reach-budget", type=int, default=18, help="most evaluations when counting evaluations to 95%%")
    p.add_argument("--max-new", type=int, default=0,
                   help="measure at most N missing grid points, then stop (0: all); lets a shared box "
                        "measure the grid in short lock holds")
    p.add_argument("--grid-only", action="store_true",
                   help="measure missing grid points and stop (the replay is CPU work, not a timed run: run it "
                        "outside the measurement's lock hold)")
    add_output_flags(p)
    args = p.parse_args(argv)
    if not args.json:
        return run(args)[0]
    with contextlib.redirect_stdout(sys.stderr):  # the text report goes to stderr, the document to stdout
        rc, report = run(args)
    if report is not None:
        c = report["conditions"]
        emit(TOOL, [{"method": name, **r} for name, r in report["replay"].items()],
             run_conditions(args, model_dir=c["model"], budget_bytes=c["budget"], threads=c["threads"], cold=True),
             True, [], notes={k: v for k, v in report.items() if k not in ("conditions", "replay")})
    return rc


def run(args) -> tuple[int, dict | None]:
    """The whole run as main() describes it: the exit status, and the report it wrote (None when
    it stopped before one: --max-new, --grid-only)."""

    import psutil
    model_dir = resolve_model(args.model)
    budget = parse_size(args.ram_budget)
    threads = psutil.cpu_count(logical=False) or 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid_path = out / "grid.json"
    conditions = {"model": str(model_dir), "budget": budget, "threads": threads, "ctx_size": args.min_ctx,
                  "tokens": args.tokens, "repeats": args.repeats, "prompt_tokens": args.prompt_tokens,
                  "seed": args.seed, "cold": True}
    table = {}
    if grid_path.exists():
        saved = json.loads(grid_path.read_text())
        if saved.get("conditions") == conditions:
            table = saved["table"]
    points = all_points()
    t0 = time.monotonic()
    measured_now = 0
    for i, point in enumerate(points):
        k = key_of(point)
        if k in table:
            continue
        if args.max_new and measured_now >= args.max_new:
            print(f"grid: {len(table)}/{len(points)} points measured; stopping (--max-new {args.max_new})",
                  file=sys.stderr)
            return 0, None
        measured_now += 1
        with bench_lock(args.lock):
            table[k] = measure(model_dir, config_of(point, budget, threads, args.min_ctx), args)
        atomic_write_text(grid_path, json.dumps({"conditions": conditions, "table": table}, indent=1))
        print(f"grid {i + 1}/{len(points)}: {k} -> {table[k]['status']} {table[k]['decode_tok_s']:.3f} tok/s "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)

    if args.grid_only:
        print(f"grid: {len(table)}/{len(points)} points measured (--grid-only)", file=sys.stderr)
        return 0, None
    grid_best = best_of(table, list(table))
    top = table[grid_best]["decode_tok_s"]
    print(f"\nGrid: {len(table)} points, best {top:.3f} tok/s at {grid_best}; baseline "
          f"{table[key_of(BASELINE)]['decode_tok_s']:.3f} tok/s")
    print(f"conditions: {args.model}, budget {format_size(budget)}, cold, {args.tokens} tokens x {args.repeats} "
          f"repeats, threads {threads}, cgroup {'yes' if table[grid_best].get('cgroup_limited') else 'no'}\n")

    replay = {}
    for name, method in METHODS.items():
        rel, used, hit = [], [], 0
        for seed in range(args.seeds):
            seen = method(table, args.trials, seed)
            pick = best_of(table, seen)
            rel.append(table[pick]["decode_tok_s"] / top if top else 0.0)
            used.append(len(seen))
            hit += pick == grid_best
        replay[name] = {"relative_median": statistics.median(rel), "relative_min": min(rel),
                        "relative_mean": statistics.fmean(rel), "evaluations_median": statistics.median(used),
                        "found_grid_best": hit, "seeds": args.seeds,
                        "seed0_pick": best_of(table, method(table, args.trials, 0))}
    print(f"Replay against the grid, {args.trials} evaluations, {args.seeds} seeds "
          f"(grid figure of each method's pick / grid best):")
    print(f"  {'method':9} {'median':>7} {'mean':>7} {'worst':>7} {'evals':>6} {'found best':>11}")
    for name, r in replay.items():
        print(f"  {name:9} {r['relative_median']:7.1%} {r['relative_mean']:7.1%} {r['relative_min']:7.1%} "
              f"{r['evaluations_median']:6.0f} {r['found_grid_best']:>5}/{r['seeds']}")
    print(f"  {'grid':9} {1:7.1%} {1:7.1%} {1:7.1%} {len(table):6d}")

    reach = {}
    if args.profile:
        predicted = predict_grid(model_dir, args.profile, budget, threads, args.min_ctx, args)
        reach = reach_table(table, predicted, top, args)

    if args.confirm_rounds <= 0:
        report = {"conditions": conditions, "grid": {"points": len(table), "best": grid_best, "best_tok_s": top},
                  "replay": replay, "reach_95": reach, "table": table}
        atomic_write_text(out / "tuner_quality.json", json.dumps(report, indent=2))
        print(f"\nwritten: {out / 'tuner_quality.json'} (no confirmation round)")
        return 0, report

    # Confirmation: distinct picks, grid best first, baseline last, interleaved.
    order = [grid_best] + [r["seed0_pick"] for r in replay.values()]
    labels: dict[str, list[str]] = {}
    for name, k in zip(["grid"] + list(replay), order):
        labels.setdefault(k, []).append(name)
    base_key = key_of(BASELINE)
    labels.setdefault(base_key, []).append("baseline")
    seq = [k for k in dict.fromkeys(order) if k != base_key] + [base_key]
    confirmed = {k: [] for k in seq}
    for rnd in range(args.confirm_rounds):
        for k in seq:
            with bench_lock(args.lock):
                r = measure(model_dir, config_of(json.loads(k), budget, threads, args.min_ctx), args)
            confirmed[k].append(r)
            print(f"confirm {rnd + 1}/{args.confirm_rounds}: {'/'.join(labels[k])}: {r['decode_tok_s']:.3f} tok/s",
                  file=sys.stderr)
    med = {k: statistics.median([r["decode_tok_s"] for r in v]) for k, v in confirmed.items()}
    ref = med[grid_best] or 1.0
    base = med[base_key] or 1.0
    print(f"\nConfirmation ({args.confirm_rounds} interleaved rounds; median decode tok/s, relative to the grid's best "
          f"and to the baseline):")
    for k in seq:
        samples = [s for r in confirmed[k] for s in (r.get("samples") or []) if s is not None]
        spread = f"{min(samples):.3f}..{max(samples):.3f}" if samples else "-"
        print(f"  {'/'.join(labels[k]):28} {med[k]:8.3f} tok/s  [{spread}]  {med[k] / ref:6.1%} of grid best  "
              f"{med[k] / base:5.2f}x baseline  {k}")

    report = {"conditions": conditions, "grid": {"points": len(table), "best": grid_best, "best_tok_s": top},
              "replay": replay, "reach_95": reach, "confirmation": {k: {"labels": labels[k], "median": med[k], "runs": confirmed[k]}
                                                 for k in seq}}
    atomic_write_text(out / "tuner_quality.json", json.dumps(report, indent=2))
    print(f"\nwritten: {out / 'tuner_quality.json'}")
    return 0, report


if __name__ == "__main__":
    sys.exit(main())
