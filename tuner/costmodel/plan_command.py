"""`colibri plan`: the memory plan, predicted figures and the best predicted config.

Also `colibri plan --calibrate RUN_DIR`: fit the factors to a tune run's trials, print the
held-out error, and store the factors in the profile (`cost_model`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from engine.api import EngineConfig, format_size
from tuner.costmodel import fit as cal
from tuner.costmodel.model_geometry import ModelGeometry, resolve
from tuner.costmodel.hardware import HardwareView, apply_what_if
from tuner.costmodel.calibrated_facts import measured_on, recall_for, routing_for
from tuner.costmodel.predict import Factors, RunConditions, predict
from tuner.costmodel.routing_model import RoutingModel, make_routing  # noqa: F401  (benchmarks import it from here)
from tuner.costmodel.best_config import rank
from tuner.probe.hardware_profile import load_profile, save_profile

# Memory a trial process spends before the model (interpreter, torch, index) when no study
# measured it: the tuner's fallback figure (tuner/search/space.py).
DEFAULT_OVERHEAD_BYTES = 310 << 20


@dataclass
class Setup:
    geometry: ModelGeometry
    quant: str
    hw: HardwareView
    routing: RoutingModel
    factors: Factors
    calibrated: bool
    overhead: int
    recall_source: str = ""  # where the lookahead recall comes from (model_facts.recall_for)


def _setup(args, profile) -> Setup:
    geometry = resolve(args.model)
    quant = args.quant or geometry.native_quant
    hw = HardwareView(profile)
    fitted = cal.factors_from_profile(profile)
    section = getattr(profile, "cost_model", None) or {}
    overhead = int(section.get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES)
    # The machine's factors carry over to any model; the router's recall only to the geometry
    # it was measured on (model_facts.py).
    recall, source = recall_for(section, geometry.to_dict())
    factors = dataclasses.replace(fitted or Factors(), lookahead_recall=recall)
    return Setup(geometry, quant, hw, make_routing(args.routing, geometry), factors, fitted is not None,
                 overhead, source)


def _base_config(args, hw: HardwareView) -> EngineConfig:
    config = EngineConfig.load(args.config) if args.config else EngineConfig()
    if args.budget:
        config = config.replace(ram_budget=args.budget)  # bytes already (argtypes.size)
    elif not config.ram_budget:
        config = config.replace(ram_budget=int(hw.ram_bytes * 0.88))
    return config


def run_plan(args) -> dict:
    profile = load_profile(args.profile)
    if args.calibrate:
        return run_calibrate(args, profile)
    profile = apply_what_if(profile, args.what_if)
    s = _setup(args, profile)
    config = _base_config(args, s.hw)
    run = RunConditions() if args.conditions == "trial" else RunConditions.steady()
    pred = predict(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run, s.overhead)
    policies = ("lru", "lfu", "pinned") if s.routing.kind == "histogram" else ("lru", "lfu")
    ranked = rank(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run, s.overhead, policies)
    return {
        "model": s.geometry.to_dict(), "quant": s.quant, "routing": s.routing.description,
        "conditions": args.conditions, "what_if": list(args.what_if), "calibrated": s.calibrated,
        "factors": s.factors.to_dict(), "lookahead_recall_source": s.recall_source,
        "profile_routing": routing_for(getattr(profile, "cost_model", None), s.geometry.to_dict()),
        "overhead_bytes": s.overhead, "config": config.to_dict(),
        "prediction": pred.to_dict(),
        "best": [{"config": r.config.to_dict(), "prediction": r.prediction.to_dict()} for r in ranked[:args.top]],
    }


def run_calibrate(args, profile) -> dict:
    geometry = resolve(args.model)
    quant = args.quant or geometry.native_quant
    hw = HardwareView(profile)
    studies = [cal.load_study(d) for d in args.calibrate]
    study = studies[0]
    overhead = next((s.overhead_bytes for s in studies if s.overhead_bytes), DEFAULT_OVERHEAD_BYTES)
    routing_path = next((s.routing_path for s in studies if s.routing_path is not None), None)
    routing_spec = str(routing_path) if args.routing == "auto" and routing_path is not None else args.routing
    routing = make_routing(routing_spec, geometry)
    all_trials = [t for s in studies for t in s.trials]
    recall = cal.measured_recall(all_trials) or Factors().lookahead_recall
    trials = []
    for s in studies:
        s.overhead_bytes = s.overhead_bytes or overhead
        trials += cal.prepare(s, geometry, quant, hw, routing, recall)
    rows = cal.cross_validate(trials, recall)
    summary = cal.error_summary(rows)
    factors = cal.fit(trials, recall)
    study.trials = all_trials
    section = cal.cost_model_section(factors, summary, geometry, quant, study)
    section["overhead_bytes"] = overhead
    section["routing"] = routing.description
    # What was measured on the studied model, keyed by its geometry: plan applies it to that
    # geometry only. The run's own result.json names the model it measured; a grid has none,
    # and is taken to be of --model.
    measured = (study.meta.get("model") or {})
    section["measured_on"] = measured_on(measured.get("geometry") or geometry.to_dict(),
                                         measured.get("name") or geometry.name, cal.measured_recall(all_trials),
                                         routing.description)
    # The run directories' names, not their paths: a profile is shared (profiles/), and a path
    # names the box's user and layout.
    section["fitted_on"]["sources"] = [Path(d).name for d in args.calibrate]
    out = {"calibration": section, "held_out": [{**r, "config": r["config"].to_dict()} for r in rows],
           "profile": os.fspath(args.profile)}
    if args.test:
        test = cal.load_study(args.test)
        test.overhead_bytes = test.overhead_bytes or overhead
        test_trials = cal.prepare(test, geometry, quant, hw, routing, recall)
        test_rows = cal.predict_rows(test_trials, factors)
        out["test"] = {"source": Path(args.test).name, "summary": cal.error_summary(test_rows),
                       "rows": [{**r, "config": r["config"].to_dict()} for r in test_rows]}
        section["test"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out["test"]["summary"].items()}
    profile.cost_model = section
    save_profile(profile, args.profile)
    return out


# --- text output --------------------------------------------------------------------------------

def format_plan(r: dict) -> str:
    if "calibration" in r:
        return format_calibration(r)
    m, p = r["model"], r["prediction"]
    lines = [f"model {m['name']} ({m['model_type']}): {m['total_params'] / 1e9:.1f}B parameters, "
             f"{m['active_params'] / 1e9:.1f}B active, {m['experts']} experts top-{m['top_k']} in "
             f"{m['moe_layers']} of {m['layers']} layers; quant {r['quant']}; routing: {r['routing']}"]
    if r["what_if"]:
        lines.append("what-if: " + ", ".join(r["what_if"]))
    lines.append(f"factors: {'calibrated' if r['calibrated'] else 'uncalibrated (the measured curves as they are)'}"
                 + "".join(f"; {k} {v:.3g}" for k, v in r["factors"].items()))
    lines.append(f"lookahead recall: {r['lookahead_recall_source']}")
    if r.get("profile_routing"):
        lines.append(f"the profile's routing statistics for this geometry: {r['profile_routing']}")
    lines.append(_format_one("this config", r["config"], p))
    for i, b in enumerate(r["best"], 1):
        lines.append(_format_one(f"best predicted #{i}", b["config"], b["prediction"]))
    if not r["best"]:
        lines.append("no config of the grid fits this budget")
    lines.append(f"conditions: {r['conditions']} ({'warm cache, long generation' if r['conditions'] == 'steady' else 'cold, 8+8 tokens, 2 repeats'})")
    return "\n".join(lines)


def _format_one(title: str, cfg: dict, p: dict) -> str:
    knobs = (f"chunk {format_size(cfg['chunk_size'])}, prefetch {cfg['prefetch_depth']}, cache ratio "
             f"{cfg['cpu_cache_ratio']}, {cfg['io_mode']}, io_threads {cfg['io_threads']}, {cfg['cache_policy']}, "
             f"threads {cfg['threads'] or 'auto'}, ctx {cfg['ctx_size']}, budget {format_size(cfg['ram_budget'])}")
    if not p["fits"]:
        return f"{title}: {knobs}\n  does not fit: {p['reason']}"
    plan = p["plan"]
    split = (f"dense {format_size(plan['dense_bytes'])} + KV {format_size(plan['kv_bytes'])} + read buffers "
             f"{format_size(plan['buffer_bytes'])} + runtime {format_size(plan['overhead_bytes'])} + RAM cache "
             f"{format_size(plan['cache_bytes'])} ({int(plan['cache_slots'])} of {plan['routed_experts']} experts)"
             f"{' + VRAM cache ' + format_size(plan['gpu_cache_bytes']) if plan['gpu_cache_bytes'] else ''}"
             if plan["streaming"] else "everything resident")
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["seconds"].items() if v)
    return (f"{title}: {knobs}\n  plan: {split}\n"
            f"  predicted: decode {p['decode_tok_s']:.3g} tok/s, TTFT {p['ttft_s']:.3g} s, RAM hit rate "
            f"{p['hit_rate']:.1%}, {format_size(p['bytes_per_token'])} read per token in "
            f"{format_size(p['read_request_bytes'])} requests at QD {p['queue_depth']}; bottleneck: {p['bottleneck']}"
            f"\n  per token: {terms}")


def _rho(v) -> str:
    return "undefined" if v is None else f"{v:.2f}"


def _pts(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_calibration(r: dict) -> str:
    c = r["calibration"]
    h = c["held_out"]
    lines = [f"calibrated on {h['trials']} trials of {c['fitted_on']['model']} ({c['fitted_on']['quant']}, budget "
             f"{format_size(c['fitted_on']['budget_bytes'])}); routing: {c['routing']}",
             "held-out (each trial predicted by factors fitted without it):",
             "| trial | io | chunk | prefetch | ratio | policy | measured tok/s | predicted | error | measured TTFT | predicted | hit meas/pred |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["held_out"]:
        cfg = row["config"]
        err = (row["predicted_decode"] - row["measured_decode"]) / row["measured_decode"] * 100
        hm = "-" if row["measured_hit_rate"] is None else f"{row['measured_hit_rate']:.0%}"
        lines.append(f"| {row['number']} | {cfg['io_mode']} | {format_size(cfg['chunk_size'])} | {cfg['prefetch_depth']} | "
                     f"{cfg['cpu_cache_ratio']} | {cfg['cache_policy']} | {row['measured_decode']:.3f} | "
                     f"{row['predicted_decode']:.3f} | {err:+.0f}% | {row['measured_ttft']:.2f} | "
                     f"{row['predicted_ttft']:.2f} | {hm}/{row['predicted_hit_rate']:.0%} |")
    lines.append(f"decode: median abs error {h['decode_median_abs_pct_error']:.1f}%, Spearman {_rho(h['decode_spearman'])}; "
                 f"TTFT: median abs error {h['ttft_median_abs_pct_error']:.1f}%, Spearman {_rho(h['ttft_spearman'])}")
    lines.append(f"RAM hit rate: median abs error {_pts(h['hit_rate_median_abs_error_points'])} points; bytes per "
                 f"token: median abs error {_pts(h['bytes_per_token_median_abs_pct_error'])}%")
    if "test" in r:
        t = r["test"]["summary"]
        lines.append(f"separate test set {r['test']['source']} ({t['trials']} trials, factors fitted on the runs above): "
                     f"decode median abs error {t['decode_median_abs_pct_error']:.1f}%, Spearman "
                     f"{_rho(t['decode_spearman'])}; TTFT {t['ttft_median_abs_pct_error']:.1f}%; hit rate "
                     f"{_pts(t['hit_rate_median_abs_error_points'])} points")
    lines.append("factors (fitted on all trials): " + ", ".join(f"{k} {v:.3g}" for k, v in c["factors"].items()))
    lines.append(f"stored in {r['profile']} under \"cost_model\"")
    return "\n".join(lines)
