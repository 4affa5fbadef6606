"""A real `colibri tune` against the exhaustive grid, its printed command, and the defaults (issue 43).

    .venv/bin/python benchmarks/tuning/tuner_unseen.py --lock /tmp/colibri-bench.lock      # the grids first
    .venv/bin/python benchmarks/tuning/tune_against_grid.py --lock /tmp/colibri-bench.lock \\
        --geometry benchmarks/tuning/geometries/wide24.json:1280MiB --profile profiles/amd-epyc-virtio-2a91f032.json

tuner_unseen.py measures every point of a grid and replays the tuner's sampler over it. This asks
what a user sees of one real tune on the same model and budget:

1. `colibri tune` as a user runs it (--trials, --time-budget, --profile), its run directory kept in
   --out/<name>/tune (an existing result there is reused: a rerun measures only what is missing);
2. the `colibri bench` command its recommended.toml prints, run --reproduce times: its figure
   against the tune's headline, and whether it measured the same thing (the same prompts, output
   tokens and bytes read per token: the result's Reproduce fields);
3. the tune's pick, the grid's best point (tuner_unseen's grid.json for this geometry) and the
   engine's defaults as the tune measured them, in --rounds interleaved rounds (the order rotated
   each round), each a cold trial in a memory cgroup of the budget with the steady workload;
4. from the result: the cost model's median error per io mode, and the minutes its warm-start
   trials took (the trials enqueued by the cost model before the sampler's own); with
   --warm-before REV, the same tune run first in REV's tree (benchmarks/trees.py) for its
   warm-start minutes before (f4ad224^: warm starts not yet gated by the calibrated error).

Prints one row per geometry through benchkit's printers (or --json: one colibri.bench/1
document); the document is also written to --out/tune_against_grid.json.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions  # noqa: E402
from benchmarks.trees import source_tree, tree_env  # noqa: E402
from benchmarks.tuning.tuner_quality import config_of  # noqa: E402
from benchmarks.tuning.tuner_unseen import GEOMETRIES, geometry_spec  # noqa: E402
from engine.api import (STEADY_TEMPERATURE, STEADY_TOP_P, ColibriError, EngineConfig,  # noqa: E402
                        atomic_write_text, format_size, synthesize)
from tuner.results.reproduce import ids_digest  # noqa: E402
from tuner.results.rundir import read_trials_csv  # noqa: E402
from tuner.results.result import TuneResult  # noqa: E402
from tuner.search.trial import run_trial, steady_args  # noqa: E402
from tuner.search.workload import STEADY_PROMPTS  # noqa: E402

TOOL = "tune_against_grid"
PY = [sys.executable, "-m", "colibri.cli"]
COLUMNS = [("geometry", lambda r: r["geometry"]), ("budget", lambda r: r["budget"]),
           ("tune headline tok/s", lambda r: r["headline"]),
           ("printed command tok/s (runs)", lambda r: f"{r['reproduce_median']} ({r['reproduce_runs']})"),
           ("command / headline", lambda r: r["reproduce_ratio"]),
           ("same tokens, bytes/token", lambda r: r["reproduce_same"]),
           ("pick tok/s", lambda r: r["pick"]), ("grid best tok/s", lambda r: r["grid_best"]),
           ("defaults tok/s", lambda r: r["defaults"]),
           ("pick / grid best", lambda r: r["pick_vs_grid"]), ("pick / defaults", lambda r: r["pick_vs_defaults"]),
           ("evaluations", lambda r: r["evaluations"]),
           ("cost model error by io mode (trials)", lambda r: r["cost_model_by_io_mode"]),
           ("warm-start trials (this tree)", lambda r: r["warm_start"]),
           ("warm-start trials (--warm-before)", lambda r: r["warm_start_before"])]


def run_tune(model_dir: Path, budget: int, tune_dir: Path, args, tree: Path = ROOT) -> Path:
    """The tune's result.json: reused from tune_dir, else `colibri tune` of `tree` (this one, or an
    older revision's for the warm-start minutes before) run there (resumed if it was cut)."""
    result = tune_dir / "result.json"
    if not result.is_file():
        argv = [*PY, "tune", "--model", str(model_dir), "--ram-budget", str(budget), "--trials", str(args.trials),
                "--time-budget", args.time_budget, "--out", str(tune_dir)]
        argv += ["--profile", str(Path(args.profile).resolve())] if args.profile else []  # cwd: the tree
        argv += ["--resume"] if tune_dir.exists() else []
        print(f"  tune: {shlex.join(argv[2:])}", file=sys.stderr)
        with bench_lock(args.lock):
            done = subprocess.run(argv, cwd=tree, env=tree_env(tree), stdout=subprocess.DEVNULL)
        if done.returncode != 0 or not result.is_file():
            raise ColibriError(f"colibri tune exited {done.returncode} without {result}")
    return result


def rerun_printed(r: TuneResult, runs: int, lock: str | None) -> list[dict]:
    """The printed `colibri bench` command run `runs` times: each run's figure and what it measured."""
    argv = shlex.split(r.reproduce.command)
    if argv[:2] != ["colibri", "bench"]:
        raise ColibriError(f"the result's reproduce command is not a colibri bench command: {r.reproduce.command}")
    out = []
    for i in range(runs):
        with bench_lock(lock):
            done = subprocess.run([*PY, *argv[1:], "--json"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise ColibriError(f"the printed command failed: {done.stderr.strip().splitlines()[-1:]}")
        got = json.loads(done.stdout)
        out.append({"decode_tok_s": got["decode_tok_s"], "bytes_read_per_token": got.get("bytes_read_per_token"),
                    "output_sha256": ids_digest(got.get("output_ids")),
                    "workload_sha256": (got.get("workload") or {}).get("sha256")})
        print(f"  printed command run {i + 1}/{runs}: {got['decode_tok_s']:.3g} tok/s", file=sys.stderr)
    return out


# Bytes read per token move a little with read timing where lookahead runs (a prediction's read is used
# or released depending on when it lands), even with the same prompts and tokens.
BYTES_TOLERANCE = 0.02


def same_measure(r: TuneResult, runs: list[dict]) -> str:
    """Whether every re-run measured what the headline measured: the same prompts and output tokens,
    and bytes read per token within BYTES_TOLERANCE (the largest deviation is printed)."""
    rep = r.reproduce
    same_tokens = all(x["workload_sha256"] == rep.workload_sha256 and x["output_sha256"] == rep.output_sha256
                      for x in runs)
    known = rep.bytes_read_per_token is not None and all(x["bytes_read_per_token"] is not None for x in runs)
    dev = max((abs(x["bytes_read_per_token"] - rep.bytes_read_per_token) / max(rep.bytes_read_per_token, 1.0)
               for x in runs), default=0.0) if known else None
    ok = same_tokens and dev is not None and dev <= BYTES_TOLERANCE
    mib = (rep.bytes_read_per_token or 0) / 2**20
    bytes_note = "bytes unknown" if dev is None else f"bytes within {dev:.2%}"
    return f"{'yes' if ok else 'NO'}, {mib:.1f} MiB ({'same tokens' if same_tokens else 'other tokens'}, {bytes_note})"


def interleaved(model_dir: Path, configs: dict[str, EngineConfig], budget: int, tokens: int, args) -> dict:
    """Each config's cold figures over `rounds` rounds, the order rotated each round."""
    names = list(configs)
    got: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            with bench_lock(args.lock):
                res = run_trial(model_dir, configs[name], tokens=tokens, repeats=1, cold=True,
                                prompt_tokens=args.prompt_tokens, seed=args.seed, limit_bytes=budget,
                                timeout=args.trial_timeout,
                                extra_args=steady_args(STEADY_PROMPTS, STEADY_TEMPERATURE, STEADY_TOP_P))
            value = (res.metrics.get("decode_tok_s") or 0.0) if res.ok else 0.0
            got[name].append(value)
            print(f"  round {rnd + 1}/{args.rounds} {name}: {res.status} {value:.3g} tok/s", file=sys.stderr)
    return got


def warm_start_minutes(tune_dir: Path) -> tuple[int, int, float]:
    """(the cost model's warm-start trials enqueued, those that ran, their wall minutes), from the
    run's trials.csv (role "model": tuner/search/warm_start.py; one the time budget cut before it ran
    has no status)."""
    rows = read_trials_csv(tune_dir / "trials.csv") if (tune_dir / "trials.csv").is_file() else []
    warm = [x for x in rows if x.get("role") == "model"]
    ran = [x for x in warm if x.get("status")]
    return len(warm), len(ran), sum(float(x.get("wall_seconds") or 0.0) for x in ran) / 60


def warm_text(counts: tuple[int, int, float]) -> str:
    enqueued, ran, minutes = counts
    return f"{ran} ran, {minutes:.1f} min" + (f" ({enqueued - ran} more enqueued)" if enqueued > ran else "")


def spread_text(values: list[float]) -> str:
    ok = [v for v in values if v > 0]
    if not ok:
        return "failed"
    return f"{statistics.median(ok):.2f} [{min(ok):.2f}..{max(ok):.2f}]"


def ratio(a: list[float], b: list[float]) -> str:
    a, b = [v for v in a if v > 0], [v for v in b if v > 0]
    return f"{statistics.median(a) / statistics.median(b):.2f}x" if a and b else "-"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", action="append", metavar="FILE:BUDGET",
                   help=f"a geometry file and its budget (default: {', '.join(Path(g).name for g in GEOMETRIES)})")
    p.add_argument("--models", default=str(Path.home() / ".cache" / "colibri" / "models"),
                   help="where the geometries are synthesized (the same as tuner_unseen.py's)")
    p.add_argument("--grids", default="reports/tuner_unseen", help="tuner_unseen.py's --out (its grid.json files)")
    p.add_argument("--trials", type=int, default=6, help="colibri tune --trials")
    p.add_argument("--time-budget", default="12m", help="colibri tune --time-budget")
    p.add_argument("--profile", default=None, help="colibri tune --profile (a saved probe; default: probe)")
    p.add_argument("--reproduce", type=int, default=3, help="runs of the printed command")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of pick, grid best and defaults")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="the grid's threads (as tuner_unseen.py)")
    p.add_argument("--ctx", type=int, default=2048, help="the grid's context (as tuner_unseen.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-timeout", type=float, default=600)
    p.add_argument("--warm-before", default=None, metavar="REV",
                   help="also run the same tune in this revision's tree (or directory) for its warm-start "
                        "minutes: f4ad224^ is before the warm starts were gated by calibrated error")
    p.add_argument("--out", default="reports/tune_against_grid")
    add_output_flags(p)
    return p.parse_args(argv)


def grid_of(geometry: dict, args) -> Path:
    """tuner_unseen.py's grid.json for this geometry (a ColibriError if it was not measured)."""
    grid_file = Path(args.grids) / geometry["name"] / "grid.json"
    if not grid_file.is_file():
        raise ColibriError(f"{grid_file}: no grid for {geometry['name']}; run benchmarks/tuning/tuner_unseen.py first")
    return grid_file


def one_geometry(geometry: dict, budget: int, args, out: Path) -> dict:
    name = geometry["name"]
    model_dir = Path(args.models).resolve() / f"unseen-{name}"
    grid_file = grid_of(geometry, args)
    if not (model_dir / "config.json").is_file():
        synthesize(geometry, model_dir, progress=True)
    table = json.loads(grid_file.read_text())["table"]
    best_key = max(table, key=lambda k: table[k]["decode_tok_s"])
    print(f"{name}: {format_size(budget)}, grid best {best_key} {table[best_key]['decode_tok_s']:.3g} tok/s",
          file=sys.stderr)
    tune_dir = out / name / "tune"
    (out / name).mkdir(parents=True, exist_ok=True)
    result_file = run_tune(model_dir, budget, tune_dir, args)
    r = TuneResult.from_dict(json.loads(result_file.read_text()), str(result_file))
    before = None
    if args.warm_before:  # the same tune in the older tree: only its trials.csv is read
        with source_tree(args.warm_before) as tree:
            run_tune(model_dir, budget, out / name / "tune-before", args, tree)
        before = warm_text(warm_start_minutes(out / name / "tune-before"))
    if r.recommended is None or r.reproduce is None or r.workload is None:
        raise ColibriError(f"{tune_dir}: the tune recommended nothing (or recorded no reproduce command)")
    tokens = int(shlex.split(r.reproduce.command)[shlex.split(r.reproduce.command).index("--tokens") + 1])
    reruns = rerun_printed(r, args.reproduce, args.lock)
    defaults = next((c for c in r.candidates if c.role == "defaults"), None)
    configs = {"pick": EngineConfig.from_dict(r.recommended.config, "recommended"),
               "grid best": config_of(json.loads(best_key), budget, args.threads, args.ctx)}
    if defaults is not None:
        configs["defaults"] = EngineConfig.from_dict(defaults.config, "defaults")
    got = interleaved(model_dir, configs, budget, tokens, args)
    cm = r.cost_model
    by_mode = ", ".join(f"{m} {e.median_abs_pct_error:.0f}% ({e.trials})" if e.median_abs_pct_error is not None
                        else f"{m} - ({e.trials})" for m, e in sorted((cm.by_io_mode if cm else {}).items()))
    head = r.recommended.confirmed.decode_tok_s if r.recommended.confirmed else None
    rep = [x["decode_tok_s"] for x in reruns]
    return {"geometry": name, "budget": format_size(budget), "headline": round(head, 2) if head else None,
            "reproduce_median": round(statistics.median(rep), 2), "reproduce_runs": ", ".join(f"{v:.2f}" for v in rep),
            "reproduce_ratio": f"{statistics.median(rep) / head:.2f}x" if head else "-",
            "reproduce_same": same_measure(r, reruns),
            "pick": spread_text(got["pick"]), "grid_best": spread_text(got["grid best"]),
            "defaults": spread_text(got.get("defaults", [])),
            "pick_vs_grid": ratio(got["pick"], got["grid best"]),
            "pick_vs_defaults": ratio(got["pick"], got.get("defaults", [])),
            "evaluations": r.study.measured_trials, "cost_model_by_io_mode": by_mode or "-",
            "cost_model_note": cm.warm_start_note if cm else "",
            "warm_start": warm_text(warm_start_minutes(tune_dir)), "warm_start_before": before or "-",
            "tokens": tokens,
            "grid_best_point": best_key, "pick_config": r.recommended.config, "samples": got}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        specs = [geometry_spec(spec) for spec in args.geometry or GEOMETRIES]
        for geometry, _ in specs:  # every grid there before anything is tuned or written
            grid_of(geometry, args)
    except ColibriError as exc:
        return refuse(TOOL, str(exc))
    out = Path(args.out).resolve()  # absolute: an older tree's tune runs with that tree as its cwd
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for geometry, budget in specs:
        try:
            rows.append(one_geometry(geometry, budget, args, out))
        except ColibriError as exc:
            return refuse(TOOL, str(exc))
    cond = run_conditions(args, workload=f"steady: {STEADY_PROMPTS} prompts, temperature {STEADY_TEMPERATURE}, "
                                         f"top-p {STEADY_TOP_P}", cold=True, cgroup_limit="the budget")
    doc = io.StringIO()
    emit(TOOL, rows, cond, True, COLUMNS, out=doc)
    atomic_write_text(out / "tune_against_grid.json", doc.getvalue())
    emit(TOOL, rows, cond, args.json, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
