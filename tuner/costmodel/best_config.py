"""The best config the cost model predicts, and what the search takes from the model.

`rank` predicts every config of a grid over the engine's knobs (the tuner's own choices, coarser
where a knob's effect is smooth) and orders the ones that fit by predicted decode tok/s. The
tuner uses the top of that list as warm starts; `curve_region` reads the probe's random-read
curve to say which request sizes and I/O thread counts are worth searching.
"""

from __future__ import annotations

import dataclasses

import itertools
from dataclasses import dataclass

from engine.api import EngineConfig

from tuner.costmodel.fit import factors_from_profile
from tuner.costmodel.model_geometry import ModelGeometry, from_model_dir
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.calibrated_facts import recall_for
from tuner.costmodel.predict import Factors, Prediction, RunConditions, predict
from tuner.costmodel.memplan import fits
from tuner.costmodel.routing_model import RoutingModel, make_routing

KiB, MiB = 1 << 10, 1 << 20
GRID = {
    "chunk_size": (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB),
    "prefetch_depth": (0, 1, 2, 4),
    "cpu_cache_ratio": (0.5, 0.75, 1.0),
    "io_mode": ("direct", "buffered", "mmap"),
    "io_threads": (1, 2, 4, 8, 16),
    "cache_policy": ("lru", "lfu"),
}


@dataclass
class Ranked:
    config: EngineConfig
    prediction: Prediction


def grid_configs(base: EngineConfig, cores: int, logical: int, policies=("lru", "lfu"), grid: dict | None = None):
    grid = dict(grid or GRID)
    grid["cache_policy"] = tuple(policies)
    threads = sorted({cores, logical})  # more threads never predict slower: the ends suffice
    keys = list(grid) + ["threads"]
    for values in itertools.product(*grid.values(), threads):
        yield base.replace(**dict(zip(keys, values)))


def rank(geometry: ModelGeometry, quant: str, base: EngineConfig, hw: HardwareView, routing: RoutingModel,
         factors: Factors, run: RunConditions, overhead_bytes: int, policies=("lru", "lfu"),
         configs=None) -> list[Ranked]:
    """Fitting configs, best predicted decode first."""
    cores = hw.physical_cores
    logical = hw.profile.system.cpu.logical_cores
    configs = configs if configs is not None else grid_configs(base, cores, logical, policies)
    out = []
    for cfg in configs:
        p = predict(geometry, quant, cfg, hw, routing, factors, run, overhead_bytes)
        if p.fits and p.decode_tok_s:
            out.append(Ranked(cfg, p))
    out.sort(key=lambda r: -r.prediction.decode_tok_s)
    return out


def curve_region(hw: HardwareView, sizes, qds, io_mode: str = "direct", rising: float = 0.05) -> dict:
    """Request sizes and queue depths where the measured read curve is still rising or flat.

    Along each axis (the other held at its best) the region runs from the smallest value to the
    last one within `rising` (5%) of the peak bandwidth: beyond it the disk is saturated and
    bigger requests or deeper queues only cost read-buffer memory and latency. The region is
    never empty.
    """
    best_qd = max(qds, key=lambda q: max(hw.read_bandwidth(s, q, io_mode) for s in sizes))
    best_size = max(sizes, key=lambda s: hw.read_bandwidth(s, best_qd, io_mode))
    return {"chunk_size": _keep_rising([(s, hw.read_bandwidth(s, best_qd, io_mode)) for s in sorted(sizes)], rising),
            "io_threads": _keep_rising([(q, hw.read_bandwidth(best_size, q, io_mode)) for q in sorted(qds)], rising)}


def _keep_rising(points: list[tuple[int, float]], tol: float) -> list[int]:
    """Every x up to the last one within `tol` of the peak: the rising part and the plateau.
    A dip before the peak (probe noise) does not cut the region short; a decline after the
    plateau does."""
    peak = max(bw for _, bw in points)
    last = max(i for i, (_, bw) in enumerate(points) if bw >= peak * (1 - tol))
    return [x for x, _ in points[:last + 1]]


def prefilter(geometry: ModelGeometry, quant: str, configs, overhead_bytes: int) -> list[EngineConfig]:
    """The configs the engine's memory plan accepts at `overhead_bytes` of runtime overhead.

    Give a lower bound of the trial process's overhead (the study's measured figure less a
    margin): the plan is monotone in the overhead, so a config the engine's own plan accepts at
    its real, larger overhead is never dropped here.
    """
    return [cfg for cfg in configs if fits(geometry, quant, cfg, overhead_bytes)]


# --- what the tuner's study takes from the model ---------------------------------------------------

WARM_START_RATIOS = (0.25, 0.5, 0.75, 1.0)


def space_grid(space, base: EngineConfig):
    """A coarse grid over a SearchSpace's own choices, as EngineConfigs the space can represent:
    categoricals in full but ctx_size at the user's minimum (a longer context only costs memory),
    ints at every value but threads at the physical and logical core counts, the cache ratio at
    quarters."""
    from optuna.distributions import CategoricalDistribution, IntDistribution
    dists = space.distributions()
    axes = {}
    for name, dist in dists.items():
        if name == "ctx_size":
            axes[name] = [min(dist.choices)]
        elif name == "threads":
            axes[name] = sorted({space.physical_cores, space.logical_cores})
        elif isinstance(dist, CategoricalDistribution):
            axes[name] = list(dist.choices)
        elif isinstance(dist, IntDistribution):
            axes[name] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            axes[name] = [v for v in WARM_START_RATIOS if dist.low <= v <= dist.high] or [dist.high]
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        yield space.config_from_params(dict(zip(names, values)))


def warm_starts(space, geometry: ModelGeometry, hw: HardwareView, routing: RoutingModel, factors: Factors,
                run: RunConditions, overhead_bytes: int, n: int = 3) -> list[Ranked]:
    """The n best predicted configs of the space, to enqueue before the sampler: distinct in what
    the engine would do (two chunk sizes above the expert span issue the same reads)."""
    ranked = rank(geometry, geometry.native_quant, space.baseline(), hw, routing, factors, run, overhead_bytes,
                  configs=space_grid(space, space.baseline()))
    out, seen = [], []
    for r in ranked:
        # Chunks larger than an expert's span make the same requests: one of them is enough.
        params = dict(space.params_of(r.config), chunk_size=r.prediction.read_request_bytes)
        if params not in seen:
            seen.append(params)
            out.append(r)
        if len(out) >= n:
            break
    return out


CURVE_TOLERANCE = 0.25  # "flat": within 25% of the peak (the probe's quick curve is noisy)


def narrow_space(space, profile) -> dict:
    """Set the space's read sizes and I/O thread counts to the probe curve's rising-or-flat
    region (the baseline's values always stay, so the baseline is a point of the space).
    Call it on a new study only; a resumed or joined study keeps the space it was made with."""
    base = space.baseline()
    # the new space's full ranges (tuner/search/space.py), read from the space itself
    region = curve_region(HardwareView(profile), space.chunk_sizes, space.io_thread_choices, "direct", CURVE_TOLERANCE)
    space.chunk_sizes = tuple(sorted(set(region["chunk_size"]) | {base.chunk_size}))
    space.io_thread_choices = tuple(sorted(set(region["io_threads"]) | {base.io_threads}))
    return {"chunk_size": list(space.chunk_sizes), "io_threads": list(space.io_thread_choices)}


def study_warm_starts(space, profile, model_dir, run: RunConditions, n: int = 3) -> list[Ranked]:
    """The n configs of the space the cost model predicts fastest, with the profile's fitted
    factors when it carries them (else the measured curves as they are)."""
    geometry = from_model_dir(model_dir)
    routing = make_routing(space.routing_histogram or "auto", geometry)
    recall, _ = recall_for(getattr(profile, "cost_model", None), geometry.to_dict())  # this model's router only
    factors = dataclasses.replace(factors_from_profile(profile) or Factors(), lookahead_recall=recall)
    return warm_starts(space, geometry, HardwareView(profile), routing, factors, run, space.overhead_bytes, n)
