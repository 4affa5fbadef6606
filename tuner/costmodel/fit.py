"""Calibration: fit the cost model's efficiency factors to a study's measured trials.

Inputs are what `colibri tune` writes in its run directory: trials.csv (every trial's config
and measured figures), result.json (the measurement conditions: tokens, repeats, prompt, cold),
profile.json (the probe), calibration.json (the trial process's measured overhead) and
routing.json (the routing histogram recorded by the calibration run).

The fit minimises squared log errors of decode tok/s and TTFT over the trials (a ratio error,
so fast and slow configs weigh the same), with bounded factors. Held-out error is measured by
cross-validation: each trial is predicted by factors fitted without it (leave-one-out up to 20
trials, 5-fold beyond), so the reported error is what a new config would see.

The fitted factors are stored in the profile under `cost_model` (COST_MODEL_SCHEMA).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from engine.api import BudgetError, ConfigError, EngineConfig, load_json_input

from tuner.costmodel.model_geometry import ModelGeometry
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.predict import Components, Factors, RunConditions, combine, components
from tuner.costmodel.routing_model import RoutingModel
from tuner.probe.profile_checks import check_factors
from tuner.results.columns import config_from_row
from tuner.results.rundir import read_trials_csv

COST_MODEL_SCHEMA = "colibri.costmodel/1"
# A trial informs the compute factors (and, prefetching, the overlap) when at least this share
# of its token is compute at the measured curves.
COMPUTE_INFORMS = 0.5
TTFT_WEIGHT = 0.5  # TTFT is noisier (one prompt pass per repeat); it informs, decode decides
# Bounds keep a fit on few trials physical: efficiencies between 2% and 5x of the measured
# curve (a trial can beat the probe when the page cache helps), overheads below 50 ms.
# Page-cache costs below 1e-7 s/B: a path slower than 10 MB/s is a broken disk, not a factor.
BOUNDS = {"eta_io": (0.02, 5.0), "eta_compute": (0.02, 5.0), "overlap": (0.0, 1.0),
          "c_request": (0.0, 0.01), "c_layer": (0.0, 0.05), "c_page_buffered": (0.0, 1e-7),
          "c_page_mmap": (0.0, 1e-7)}
# Starts of the multi-start fit, per factor (the overlap term's min() makes the surface piecewise).
STARTS = {"eta_io": (1.0, 0.3, 2.0), "eta_compute": (1.0, 0.5, 2.0), "overlap": (0.5, 0.1, 0.9),
          "c_request": (1e-4, 1e-5, 1e-3), "c_layer": (1e-3, 1e-2, 1e-4), "c_page_buffered": (1e-9, 1e-10, 5e-9),
          "c_page_mmap": (1e-9, 1e-10, 5e-9)}


@dataclass
class Trial:
    number: int
    config: EngineConfig
    decode_tok_s: float
    ttft_s: float
    hit_rate: float | None = None
    bytes_per_token: float | None = None
    lookahead_recall: float | None = None
    comps: Components | None = None
    predicted_hit_rate: float | None = None
    predicted_bytes: float | None = None


@dataclass
class Study:
    trials: list[Trial]
    run: RunConditions
    overhead_bytes: int
    budget: int
    profile_path: Path | None = None
    routing_path: Path | None = None
    meta: dict = field(default_factory=dict)




def load_study(run_dir: str | Path) -> Study:
    """The feasible, measured trials of a tune run directory (or of a tuner_quality grid.json:
    the same trial runner, every point of a small grid measured once)."""
    run_dir = Path(run_dir)
    if run_dir.name == "grid.json" or (run_dir / "grid.json").is_file() and not (run_dir / "trials.csv").is_file():
        return load_grid(run_dir if run_dir.name == "grid.json" else run_dir / "grid.json")
    csv_path = run_dir / "trials.csv"
    if not os.path.lexists(csv_path):
        raise ConfigError(f"{run_dir}: no trials.csv (give a `colibri tune` run directory)")
    meta = _read_json(run_dir / "result.json")
    cond = meta.get("conditions", {})
    calib = _read_json(run_dir / "calibration.json")
    budget = int(meta.get("budget_bytes") or calib.get("budget") or 0)
    run = RunConditions(prompt_tokens=int(cond.get("prompt_tokens", 8)), tokens=int(cond.get("tokens", 8)),
                        repeats=int(cond.get("repeats", 2)), cold=bool(cond.get("cold", True)))
    overhead = int(cond.get("precheck_overhead_bytes") or calib.get("overhead_bytes") or 0)
    trials = []
    for i, row in enumerate(read_trials_csv(csv_path)):
        try:
            trial = _trial_from_row(row, budget, run_dir)
        except (KeyError, TypeError, ValueError) as exc:  # a column missing, or a figure that is not a number
            raise ConfigError(f"{csv_path}: row {i + 1}: bad or missing column ({exc})") from None
        if trial is not None:
            trials.append(trial)
    if not trials:
        raise ConfigError(f"{csv_path}: no feasible measured trial to calibrate on")
    routing = run_dir / "routing.json"
    profile = run_dir / "profile.json"
    return Study(trials, run, overhead, budget, profile if profile.is_file() else None,
                 routing if routing.is_file() else None, meta)


def _trial_from_row(row: dict, budget: int, run_dir: Path) -> Trial | None:
    """One feasible measured trial of trials.csv; None for the rows calibration skips."""
    if row.get("status") != "ok" or row.get("feasible") != "True" or not row.get("decode_tok_s"):
        return None
    if row.get("duplicate_of"):
        return None
    # Every setting the row records (the column registry); the budget and the routing histogram
    # are the run directory's, wherever it now is.
    config = config_from_row(row, ram_budget=budget or int(float(row.get("plan_cache_bytes") or 0)))
    config = config.replace(routing_histogram=str(run_dir / "routing.json") if config.cache_policy == "pinned" else "")
    return Trial(int(row["number"]), config, float(row["decode_tok_s"]), float(row["ttft_s"]),
                 _num(row.get("hit_rate_ram")), _num(row.get("bytes_read_per_token")),
                 _num(row.get("lookahead_recall")))


def load_grid(path: Path) -> Study:
    """benchmarks/tuning/tuner_quality.py's measured grid as a study."""
    data = _read_json(path)
    cond, table = data.get("conditions") or {}, data.get("table") or {}
    if not table:
        raise ConfigError(f"{path}: no measured grid points")
    budget = int(cond["budget"])
    run = RunConditions(prompt_tokens=int(cond["prompt_tokens"]), tokens=int(cond["tokens"]),
                        repeats=int(cond["repeats"]), cold=bool(cond.get("cold", True)))
    trials = []
    for i, (key, m) in enumerate(sorted(table.items())):
        if m.get("status") != "ok" or not m.get("decode_tok_s"):
            continue
        # The grid's fixed knobs, as benchmarks/tuning/tuner_quality.py's config_of sets them.
        config = EngineConfig(ram_budget=budget, threads=int(cond["threads"]), ctx_size=int(cond["ctx_size"]),
                              io_threads=4, cache_policy="lru", **json.loads(key))
        trials.append(Trial(1000 + i, config, float(m["decode_tok_s"]), float(m["ttft_s"]), m.get("hit_rate")))
    return Study(trials, run, 0, budget, None, None, {"source": str(path)})


def _read_json(path: Path) -> dict:
    if not os.path.lexists(path):
        return {}
    data = load_json_input(path, "calibration" if path.name != "result.json" else "result.json", error=ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _num(text) -> float | None:
    try:
        v = float(text)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


# --- fitting ------------------------------------------------------------------------------------

def measured_recall(trials: list[Trial]) -> float | None:
    vals = [t.lookahead_recall for t in trials if t.config.prefetch_depth > 0 and t.lookahead_recall is not None]
    return statistics.median(vals) if vals else None


def prepare(study: Study, geometry: ModelGeometry, quant: str, hw: HardwareView, routing: RoutingModel,
            recall: float) -> list[Trial]:
    """Factor-free components of every trial (the slow part: plan + cache simulation)."""
    ready = []
    for t in study.trials:
        try:
            plan, rates, comps, _, _ = components(geometry, quant, t.config, hw, routing, study.run,
                                                  study.overhead_bytes, recall, seed=t.number)
        except BudgetError:
            continue  # measured but the plan (at the study's overhead) refuses it: nothing to fit
        t.comps = comps
        # The bench reports the last repeat's hit rate (engine/run/bench.py); lfu's counts carry over
        # between cold repeats, so it is not the mean of the repeats.
        t.predicted_hit_rate = (rates.decode_last if rates.decode_last is not None else rates.decode) if rates else 1.0
        t.predicted_bytes = ((rates.decode_misses_per_token + rates.wasted_prefetch_per_token)
                             * plan.expert_disk_bytes) if rates else 0.0
        ready.append(t)
    return ready


def informed(trials: list[Trial]) -> tuple[str, ...]:
    """The factors these trials can tell anything about: a page-cache cost only when some trial
    read through that mode, the compute factors only when some trial is compute-bound enough, the
    overlap only when some such trial prefetched. The others stay at
    their defaults (no evidence, no cost) instead of drifting wherever the optimiser left them."""
    modes = {t.config.io_mode for t in trials}
    skip = {"c_page_buffered"} if "buffered" not in modes else set()
    skip |= {"c_page_mmap"} if "mmap" not in modes else set()
    # Compute efficiency and per-layer overhead only when some trial's token is at least half
    # compute at the measured curves: where every token waits on the disk they cannot be told
    # from each other or from the overlap, and left free they land anywhere (two disk-bound
    # demo studies fitted c_layer 5.1 ms and 0, eta_compute 0.99 and 0.54) and then decide
    # every compute-bound prediction: resident demo at 5.5-24 tok/s against 46 measured.
    if not any(compute_share(t.comps) >= COMPUTE_INFORMS for t in trials if t.comps is not None):
        skip |= {"eta_compute", "c_layer"}
    # The overlap scales the compute term (it hides at most overlap · compute of the reads), so
    # the same test, over the trials that prefetched: a disk-bound token has too little compute
    # for the overlap to move it beyond the trials' noise (demo studies fitted 0.12-0.80), and
    # the engine's mechanism (reads on their own threads while the layers compute) says 1.
    if not any(compute_share(t.comps) >= COMPUTE_INFORMS for t in trials
               if t.comps is not None and t.config.prefetch_depth > 0):
        skip.add("overlap")
    return tuple(k for k in Factors.FITTED if k not in skip)


def compute_share(c: Components) -> float:
    """Share of a decode token that is compute at the measured curves (no fitted factor)."""
    total = c.compute_s + c.disk_s
    return c.compute_s / total if total > 0 else 1.0


def _factors(names: tuple[str, ...], x: np.ndarray, recall: float) -> Factors:
    return Factors(**dict(zip(names, map(float, x))), lookahead_recall=recall)


def fit(trials: list[Trial], recall: float) -> Factors:
    """Least-squares factors over prepared trials."""
    from scipy.optimize import least_squares
    if not trials:
        raise ConfigError("no trials to fit")
    names = informed(trials)
    lo = np.array([BOUNDS[k][0] for k in names])
    hi = np.array([BOUNDS[k][1] for k in names])
    y_dec = np.log([t.decode_tok_s for t in trials])
    y_ttft = np.log([t.ttft_s for t in trials])

    def residuals(x):
        f = _factors(names, x, recall)
        out = [combine(t.comps, f) for t in trials]
        r1 = -np.log([o["token_s"] for o in out]) - y_dec
        r2 = (np.log([o["ttft_s"] for o in out]) - y_ttft) * TTFT_WEIGHT
        return np.concatenate([r1, r2])

    best = None
    for i in range(len(STARTS["eta_io"])):
        x0 = np.clip(np.array([STARTS[k][i] for k in names]), lo + 1e-12, hi - 1e-12)
        res = least_squares(residuals, x0, bounds=(lo, hi), x_scale=np.maximum(np.abs(x0), 1e-10))
        if best is None or res.cost < best.cost:
            best = res
    return _factors(names, best.x, recall)


def predict_rows(trials: list[Trial], f: Factors) -> list[dict]:
    """Measured next to predicted figures for each prepared trial, with factors `f`."""
    out = []
    for t in trials:
        o = combine(t.comps, f)
        out.append({"number": t.number, "measured_decode": t.decode_tok_s, "predicted_decode": 1 / o["token_s"],
                    "measured_ttft": t.ttft_s, "predicted_ttft": o["ttft_s"], "bottleneck": o["bottleneck"],
                    "measured_hit_rate": t.hit_rate, "predicted_hit_rate": t.predicted_hit_rate,
                    "measured_bytes": t.bytes_per_token, "predicted_bytes": t.predicted_bytes, "config": t.config})
    return out


def cross_validate(trials: list[Trial], recall: float, folds: int | None = None) -> list[dict]:
    """Each trial's figures predicted by factors fitted without it: `folds`-fold (interleaved by
    trial order), leave-one-out for folds = 0; by default leave-one-out up to 20 trials, else 5."""
    n = len(trials)
    k_folds = (0 if n <= 20 else 5) if folds is None else folds
    folds = [[i] for i in range(n)] if k_folds == 0 or k_folds >= n else [list(range(k, n, k_folds))
                                                                          for k in range(k_folds)]
    out = []
    for held in folds:
        train = [t for i, t in enumerate(trials) if i not in held]
        if len(train) < 3:
            raise ConfigError(f"{n} trials are too few to hold any out (need at least 4)")
        f = fit(train, recall)
        out += predict_rows([trials[i] for i in held], f)
    return sorted(out, key=lambda r: r["number"])


def error_summary(rows: list[dict]) -> dict:
    from scipy.stats import spearmanr

    def pct(p, m):
        return abs(p - m) / m * 100

    dec = [pct(r["predicted_decode"], r["measured_decode"]) for r in rows]
    ttft = [pct(r["predicted_ttft"], r["measured_ttft"]) for r in rows]
    rho = spearmanr([r["predicted_decode"] for r in rows], [r["measured_decode"] for r in rows]).statistic
    rho_t = spearmanr([r["predicted_ttft"] for r in rows], [r["measured_ttft"] for r in rows]).statistic
    hits = [abs(r["predicted_hit_rate"] - r["measured_hit_rate"]) * 100 for r in rows
            if r["measured_hit_rate"] is not None]
    byt = [pct(r["predicted_bytes"], r["measured_bytes"]) for r in rows if r["measured_bytes"]]
    return {"trials": len(rows), "decode_median_abs_pct_error": statistics.median(dec),
            "decode_spearman": _finite(rho), "ttft_median_abs_pct_error": statistics.median(ttft),
            "ttft_spearman": _finite(rho_t),
            "hit_rate_median_abs_error_points": statistics.median(hits) if hits else None,
            "bytes_per_token_median_abs_pct_error": statistics.median(byt) if byt else None}


def errors_by_kind(rows: list[dict]) -> dict:
    """Held-out decode error per io mode and per cache policy (the profile's held_out_by_kind):
    one set of factors is fitted, but its error differs by kind (a page-cache cost with no
    buffered trial stays at its default), and the tune trusts a kind only where it is known."""
    out: dict = {"io_mode": {}, "cache_policy": {}}
    for kind in out:
        for value in sorted({getattr(r["config"], kind) for r in rows}):
            errs = [abs(r["predicted_decode"] - r["measured_decode"]) / r["measured_decode"] * 100
                    for r in rows if getattr(r["config"], kind) == value and r["measured_decode"]]
            out[kind][value] = {"trials": len(errs),
                                "decode_median_abs_pct_error": round(statistics.median(errs), 2) if errs else None}
    return out


def _finite(x) -> float | None:
    """A rank correlation of fewer than two distinct points is undefined: None, never NaN (a
    profile is strict JSON)."""
    x = float(x)
    return x if math.isfinite(x) else None


# --- the profile's cost_model section -----------------------------------------------------------

def cost_model_section(factors: Factors, summary: dict, geometry: ModelGeometry, quant: str, study: Study) -> dict:
    return {
        "schema": COST_MODEL_SCHEMA,
        "factors": {k: float(v) for k, v in factors.to_dict().items()},
        "fitted_on": {"model": geometry.name, "quant": quant, "budget_bytes": study.budget,
                      "trials": len(study.trials), "conditions": {
                          "prompt_tokens": study.run.prompt_tokens, "tokens": study.run.tokens,
                          "repeats": study.run.repeats, "cold": study.run.cold}},
        "held_out": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()},
        "created_utc": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
    }


def factors_from_profile(profile) -> Factors | None:
    """The fitted factors a profile carries, or None when it was never calibrated."""
    section = getattr(profile, "cost_model", None) or {}
    if not section:
        return None
    if section.get("schema") != COST_MODEL_SCHEMA or not isinstance(section.get("factors"), dict):
        raise ConfigError(f"profile.cost_model: expected schema {COST_MODEL_SCHEMA!r} with a 'factors' object")
    # The profile's physical ranges (tuner/probe/profile_checks.py), also checked when it was loaded.
    check_factors(section["factors"], "profile.cost_model.factors", ConfigError)
    return Factors.from_dict(section["factors"])
