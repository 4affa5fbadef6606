"""Predicted decode tok/s of the bundled real-model geometries, on this machine and on described ones.

    .venv/bin/python benchmarks/tuning/extrapolation.py --profile PROFILE.json [--json]

For GLM-5 744B, DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x22B and OLMoE-1B-7B at int4 and int8,
the cost model (tuner/costmodel) predicts the best config of a grid on each machine, cold (the
first 16 tokens after the page cache and the engine's caches are emptied) and warm (steady state
of a long generation), with the factors the profile's `cost_model` section carries (fitted on
this machine's demo study). Described machines are this machine's profile with what-if edits of
the figures that describe them; every other figure (per-core matmul rate, the fitted
efficiencies) is this machine's measurement, which is the main caveat of the table.

Published figures (ANCHORS.md, Colibrì's measurements) are printed next to the predictions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.api import EngineConfig  # noqa: E402
from tuner.costmodel.fit import factors_from_profile  # noqa: E402
from tuner.costmodel.plan_command import DEFAULT_OVERHEAD_BYTES, make_routing  # noqa: E402
from tuner.costmodel.model_geometry import resolve  # noqa: E402
from tuner.costmodel.hardware import HardwareView, apply_what_if  # noqa: E402
from tuner.costmodel.predict import Factors, RunConditions  # noqa: E402
from tuner.costmodel.best_config import grid_configs, rank  # noqa: E402
from tuner.probe.hardware_profile import load_profile  # noqa: E402
from benchmarks.benchkit import conditions, emit  # noqa: E402

MiB = 1 << 20
MODELS = ("glm-5", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "olmoe-1b-7b")
QUANTS = ("int4", "int8")
# The described machines: the figures that describe them, as what-if edits of this profile.
MACHINES = {
    "this machine": [],
    "25 GB laptop, ~1 GB/s disk": ["ram=25GB", "disk_bw=1GB/s", "cores=8", "memory_bw=60GB/s"],
    "64-core EPYC, 4 NVMe RAID0": ["cores=64", "ram=768GB", "disk_bw=24GB/s", "memory_bw=300GB/s"],
    "128 GB desktop": ["ram=128GB", "cores=16", "disk_bw=6GB/s", "memory_bw=80GB/s"],
    "16 GB Apple M3": ["ram=16GB", "cores=8", "disk_bw=3GB/s", "memory_bw=100GB/s"],
}
# Published figures (../shared/notes/ANCHORS.md): (model, quant, machine) -> text.
ANCHORS = {
    ("glm-5", "int4", "25 GB laptop, ~1 GB/s disk"): "0.05-0.1 cold (Colibrì, 25 GB dev box)",
    ("glm-5", "int4", "128 GB desktop"): "~1.8 warm (Colibrì, CPU-only)",
    ("glm-5", "int4", "64-core EPYC, 4 NVMe RAID0"): "2.83 rotating median, 6.91 fully warm (Colibrì)",
    ("olmoe-1b-7b", "int8", "16 GB Apple M3"): "3.69 cold -> 4.18 warm (Colibrì)",
}
SMALL_GRID = {
    "chunk_size": (1 * MiB, 4 * MiB, 16 * MiB),
    "prefetch_depth": (0, 1, 2),
    "cpu_cache_ratio": (1.0,),
    "io_mode": ("direct", "buffered"),
    "io_threads": (4, 16),
    "cache_policy": ("lru", "lfu"),
}
COLD = RunConditions(prompt_tokens=8, tokens=16, repeats=1, cold=True, prelude_tokens=0)  # no bench warm-up


def predict_best(geometry, quant, hw, factors, routing, run, overhead):
    base = EngineConfig(ram_budget=int(hw.ram_bytes * 0.88), ctx_size=4096)
    cores = hw.physical_cores
    configs = list(grid_configs(base, cores, hw.profile.system.cpu.logical_cores, SMALL_GRID["cache_policy"],
                                SMALL_GRID))
    ranked = rank(geometry, quant, base, hw, routing, factors, run, overhead, configs=configs)
    return ranked[0] if ranked else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    fitted = factors_from_profile(profile)
    sets = {"curves": Factors()}  # the measured curves as they are: no overhead, full efficiency
    if fitted is not None:
        sets["calibrated"] = fitted
    overhead = int((profile.cost_model or {}).get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES)
    rows = []
    for machine, edits in MACHINES.items():
        hw = HardwareView(apply_what_if(profile, edits))
        if fitted is not None:
            sets["calibrated"] = _transferable(fitted, edits)
        for name in args.models.split(","):
            g = resolve(name)
            routing = make_routing("auto", g)
            for quant in QUANTS:
                row = {"machine": machine, "what_if": edits, "model": name, "quant": quant,
                       "published": ANCHORS.get((name, quant, machine), "")}
                for label, factors in sets.items():
                    warm = predict_best(g, quant, hw, factors, routing, RunConditions.steady(), overhead)
                    cold = predict_best(g, quant, hw, factors, routing, COLD, overhead)
                    row[label] = {
                        "warm_tok_s": warm.prediction.decode_tok_s if warm else None,
                        "warm_bottleneck": warm.prediction.bottleneck if warm else "does not fit",
                        "warm_hit_rate": warm.prediction.hit_rate if warm else None,
                        "gb_read_per_token": (warm.prediction.bytes_per_token or 0) / 1e9 if warm else None,
                        "cold_tok_s": cold.prediction.decode_tok_s if cold else None,
                        "config": warm.config.to_dict() if warm else None}
                rows.append(row)
                print(f"{machine:28} {name:16} {quant}: " + "; ".join(
                    f"{k} warm {_f(v['warm_tok_s'])} ({v['warm_bottleneck']}) cold {_f(v['cold_tok_s'])}"
                    for k, v in row.items() if isinstance(v, dict) and "warm_tok_s" in v), file=sys.stderr)
    cal = "calibrated" in sets

    def speeds(label):
        return lambda r: f"{_f(r[label]['warm_tok_s'])} / {_f(r[label]['cold_tok_s'])}"

    columns = [("machine", lambda r: r["machine"]), ("model", lambda r: r["model"]), ("quant", lambda r: r["quant"]),
               ("curves only: warm / cold tok/s", speeds("curves")),
               ("bottleneck", lambda r: r["curves"]["warm_bottleneck"]),
               ("warm RAM hit", lambda r: None if r["curves"]["warm_hit_rate"] is None
                else f"{r['curves']['warm_hit_rate']:.0%}"),
               ("GB read/token", lambda r: None if r["curves"]["gb_read_per_token"] is None
                else f"{r['curves']['gb_read_per_token']:.2f}")]
    if cal:
        columns += [("calibrated: warm / cold tok/s", speeds("calibrated")),
                    ("bottleneck", lambda r: r["calibrated"]["warm_bottleneck"])]
    columns.append(("published", lambda r: r["published"] or ""))
    notes = {"machines (what-if edits of the profile)": "; ".join(
        f"{m}: {', '.join(e) or 'as measured'}" for m, e in MACHINES.items())}
    for label, f in sets.items():
        notes[f"factors ({label})"] = ", ".join(f"{k} {v:.3g}" for k, v in f.to_dict().items())
    emit("extrapolation", rows, conditions(profile=args.profile, routing="synth skew 1 (make_routing auto)",
                                           budget="88% of RAM", ctx=4096, quant_scope="all"),
         args.json, columns, notes=notes)
    return 0

def _transferable(f: Factors, edits: list[str]) -> Factors:
    """The fitted factors for a described machine. A what-if that names the disk's bandwidth
    describes what that disk achieves, so an I/O efficiency above 1 — this machine's engine reads
    beating its own probe, as a virtual disk whose host caches the model file lets them — is
    capped at 1 there; everything else (overheads, compute efficiency) stays as fitted."""
    from dataclasses import replace
    if any(e.startswith(("disk_bw=", "disk_scale=")) for e in edits):
        return replace(f, eta_io=min(f.eta_io, 1.0))
    return f


def _f(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}"


if __name__ == "__main__":
    sys.exit(main())
