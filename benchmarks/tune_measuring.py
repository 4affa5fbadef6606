"""How a tune run spent its wall time: measured trials, re-proposals, the share spent measuring,
and the recommendation against the engine's defaults and the rules-of-thumb baseline.

    python benchmarks/tune_measuring.py RUN_DIR [RUN_DIR ...] [--json]

Reads each `colibri tune` run directory (trials.csv, result.json, calibration.json), of any
version: a run from before re-proposals were counted apart is read the same way (a re-proposal
is a trials.csv row with `duplicate_of` set). The measuring time is computed alike for every run:
the calibration run + every measured trial's wall + every confirmation run's wall; the share is
that over the run's wall time (result.json conditions.wall_seconds).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for d in args.runs:
        if not (d / "result.json").is_file() or not (d / "trials.csv").is_file():
            print(f"tune_measuring: {d}: not a finished tune run directory (no result.json / trials.csv)",
                  file=sys.stderr)
            return 2
        rows.append(summarize(d))
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
