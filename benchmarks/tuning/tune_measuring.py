"""How a tune run spent its wall time: measured trials, re-proposals, the share spent measuring,
and the recommendation against the engine's defaults and the rules-of-thumb baseline.

    python benchmarks/tuning/tune_measuring.py RUN_DIR [RUN_DIR ...] [--json]

Reads each `colibri tune` run directory (trials.csv, result.json, calibration.json), of any
version: a run from before re-proposals were counted apart is read the same way (a re-proposal
is a trials.csv row with `duplicate_of` set). The measuring time is computed alike for every run:
the calibration run + every measured trial's wall + every confirmation run's wall; the share is
that over the run's wall time (result.json conditions.wall_seconds).

Two runs on a noisy disk, minutes apart, are not one measurement: with
`--remeasure NAME=TREE [NAME=TREE ...]` the runs' baseline and recommended configs are measured
again now, each under each named source tree's own CLI (`colibri bench`, cold, in a cgroup of the
budget), interleaved for `--rounds` rounds, so a tree-to-tree difference of the same config is a
ratio within one run. Timed: run it under `quiet bench`.

    python benchmarks/tuning/tune_measuring.py before after --remeasure before=../tune-before after=. --rounds 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.benchkit

from benchmarks.benchkit import emit, run_conditions  # noqa: E402

# The knobs every version of `colibri bench` takes as flags (a config TOML of a newer version may
# carry keys an older one refuses).
BENCH_FLAGS = ("ram_budget", "chunk_size", "prefetch_depth", "cpu_cache_ratio", "threads", "ctx_size", "io_mode",
               "io_threads", "cache_policy")


def summarize(run_dir: Path) -> dict:
    result = json.loads((run_dir / "result.json").read_text())
    calib = run_dir / "calibration.json"
    calib_s = float(json.loads(calib.read_text()).get("wall_seconds") or 0.0) if calib.is_file() else 0.0
    with (run_dir / "trials.csv").open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("state") == "COMPLETE"]
    measured = [r for r in rows if not r.get("duplicate_of")]
    params = ("chunk_size", "prefetch_depth", "cpu_cache_ratio", "threads", "ctx_size", "io_mode", "io_threads",
              "cache_policy", "gpu_cache_ratio")
    distinct = {tuple(r.get(p, "") for p in params) for r in measured}
    trial_s = sum(float(r["wall_seconds"] or 0.0) for r in measured)
    confirm_s = sum(run.get("wall_seconds") or 0.0
                    for c in result.get("candidates") or [] for run in c.get("runs") or [])
    wall = float(result["conditions"]["wall_seconds"])

    def tok_s(key):
        return ((result.get(key) or {}).get("confirmed") or {}).get("decode_tok_s")

    return {"run": run_dir.name, "schema": result["schema"], "model": result["model"]["name"],
            "budget": result["budget"], "wall_s": wall, "optuna_trials": len(rows), "measured": len(measured),
            "re_proposals": len(rows) - len(measured), "distinct_points": len(distinct),
            "explored": sum(r.get("role") == "explore" for r in measured),
            "stop": (result.get("study") or {}).get("stop_reason"),
            "measuring_s": round(calib_s + trial_s + confirm_s, 1),
            "measuring_share": round((calib_s + trial_s + confirm_s) / wall, 3) if wall else None,
            "recommended_tok_s": tok_s("recommended"), "defaults_tok_s": tok_s("defaults"),
            "baseline_tok_s": tok_s("baseline"), "gain_over_defaults": result.get("gain_over_defaults"),
            "gain_over_baseline": result.get("gain_over_baseline")}


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("run", "wall s", "Optuna trials", "measured", "re-proposals", "distinct", "explored", "stop",
            "measuring s", "share measuring", "recommended tok/s", "defaults tok/s", "baseline tok/s",
            "gain vs defaults", "gain vs baseline")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([
            r["run"], _f(r["wall_s"], ".0f"), str(r["optuna_trials"]), str(r["measured"]), str(r["re_proposals"]),
            str(r["distinct_points"]), str(r["explored"]), r["stop"] or "-", _f(r["measuring_s"], ".0f"),
            _f(r["measuring_share"], ".1%"), _f(r["recommended_tok_s"], ".2f"), _f(r["defaults_tok_s"], ".2f"),
            _f(r["baseline_tok_s"], ".2f"), _f(r["gain_over_defaults"], "+.1%"), _f(r["gain_over_baseline"], "+.1%"),
        ]) + " |")
    return "\n".join(out)


def bench_config(tree: Path, model: str, config: dict, tokens: int, repeats: int) -> dict:
    """One cold `colibri bench` of config under tree's own code; its decode tok/s (median of repeats)."""
    cmd = [sys.executable, "-m", "colibri.cli", "bench", "--model", model, "--json", "--cold", "--repeats", str(repeats),
           "--tokens", str(tokens), "--prompt-tokens", "8", "--cgroup-limit", str(config["ram_budget"])]
    for k in BENCH_FLAGS:
        cmd += [f"--{k.replace('_', '-')}", str(config[k])]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"}
    return {"decode_tok_s": json.loads(proc.stdout).get("decode_tok_s")}


def remeasure(run_dirs: list[Path], trees: dict[str, Path], rounds: int) -> list[dict]:
    """Every run's baseline and recommended config x every tree, interleaved per round."""
    configs = []
    for d in run_dirs:
        result = json.loads((d / "result.json").read_text())
        for key in ("baseline", "recommended"):
            config = {k: result[key]["config"][k] for k in BENCH_FLAGS}
            same = [i for i, c in enumerate(configs) if c[1] == config]
            if same:  # one config (e.g. the baseline, unchanged between versions) is measured once
                configs[same[0]] = (f"{configs[same[0]][0]} = {d.name} {key}", config, configs[same[0]][2])
            else:
                configs.append((f"{d.name} {key}", config, result["model"]["name"]))
    figures: dict[tuple[str, str], list] = {}
    for r in range(rounds):
        for label, config, model in configs:
            for tree_name, tree in trees.items():
                got = bench_config(tree, model, config, 8, 2)
                figures.setdefault((label, tree_name), []).append(got.get("decode_tok_s") or got.get("error"))
                print(f"tune_measuring: round {r + 1}/{rounds}: {label} under {tree_name}: {got}", file=sys.stderr)
    rows = []
    for label, config, _ in configs:
        row = {"config": label, **{k: config[k] for k in BENCH_FLAGS[1:]}}
        for tree_name in trees:
            runs = figures[(label, tree_name)]
            ok = [v for v in runs if isinstance(v, float)]
            row[tree_name] = {"median": statistics.median(ok) if ok else None, "runs": runs}
        rows.append(row)
    return rows


def remeasure_table(rows: list[dict], trees: list[str]) -> str:
    head = ("config", *BENCH_FLAGS[1:], *(f"{t}: decode tok/s median (runs)" for t in trees))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], *(str(r[k]) for k in BENCH_FLAGS[1:])]
        for t in trees:
            runs = ", ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r[t]["runs"])
            cells.append(f"{_f(r[t]['median'], '.2f')} ({runs})")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--remeasure", nargs="+", metavar="NAME=TREE",
                    help="measure the runs' baseline and recommended configs again under each source tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    trees = {}
    for spec in args.remeasure or []:
        name, sep, tree = spec.partition("=")
        if not sep or not (Path(tree) / "tuner" / "cli.py").is_file():
            print(f"tune_measuring: --remeasure {spec!r}: expected NAME=TREE, TREE a colibri-tune source tree",
                  file=sys.stderr)
            return 2
        trees[name] = Path(tree).resolve()
    rows = []
    for d in args.runs:
        if not (d / "result.json").is_file() or not (d / "trials.csv").is_file():
            print(f"tune_measuring: {d}: not a finished tune run directory (no result.json / trials.csv)",
                  file=sys.stderr)
            return 2
        rows.append(summarize(d))
    again = remeasure(args.runs, trees, args.rounds) if trees else None
    if args.json:
        emit("tune_measuring", rows, run_conditions(args), True, [], notes={"remeasured": again} if trees else None)
        return 0
    print(table(rows))
    if again:
        print()
        print(remeasure_table(again, list(trees)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
