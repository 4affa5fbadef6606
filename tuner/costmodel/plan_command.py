"""`colibri plan`: the memory plan, predicted figures and the best predicted config.

Also `colibri plan --calibrate RUN_DIR`: fit the factors to a tune run's trials, print the
held-out error, and store the factors in the profile (`cost_model`).

run_plan takes a typed PlanRequest (colibri/commands/machine.py builds it from the command line)
and returns a PlanResult or CalibrationResult (engine/api/results.py), which
tuner/results/plan_printers.py prints.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from engine.api import CalibrationResult, EngineConfig, PlanResult
from tuner.costmodel import fit as cal
from tuner.costmodel.model_geometry import ModelGeometry, resolve
from tuner.costmodel.hardware import HardwareView, apply_what_if
from tuner.costmodel.calibrated_facts import calibration_text, measured_on, recall_for, routing_for
from tuner.costmodel.batch_model import predict_batch
from tuner.costmodel.predict import Factors, RunConditions, predict, predict_prefill
from tuner.costmodel.routing_model import RoutingModel, make_routing  # noqa: F401  (benchmarks import it from here)
from tuner.costmodel.best_config import rank
from tuner.costmodel.speculative import draft_prediction
from tuner.probe.hardware_profile import load_profile, save_profile

# Memory a trial process spends before the model (interpreter, torch, index) when no study
# measured it: the tuner's fallback figure (tuner/search/space.py).
DEFAULT_OVERHEAD_BYTES = 310 << 20


@dataclass(frozen=True)
class PlanRequest:
    """What `colibri plan` is asked (its flags, colibri/commands/machine.py add_plan_arguments)."""

    model: str  # model directory, bundled geometry name or geometry JSON
    profile: str  # hardware profile JSON
    quant: str | None = None  # default: the model's own
    config: str | None = None  # engine config TOML to predict (default: the engine's defaults)
    budget: int | None = None  # bytes (default: the config's, else 88% of the profile's memory)
    what_if: tuple[str, ...] = ()  # KEY=VALUE edits of measured figures (hardware.apply_what_if)
    routing: str = "auto"
    conditions: str = "steady"  # or "trial": the tuner's cold short trial
    top: int = 3  # best predicted configs to list
    prompt_tokens: int | None = None  # also: TTFT of a prompt of this many new tokens (predict_prefill)
    cached_tokens: int = 0  # ... after this many reused ones
    batch: tuple[int, ...] = ()  # batch sizes to predict a batched step for (engine/arch/decode_rows.py)
    calibrate: tuple[str, ...] = ()  # tune run directories / grids to fit the factors to
    test: str | None = None  # with calibrate: a separate hold-out run
    # speculative decoding at this acceptance (tuner/costmodel/speculative.py), up to the config's
    # draft_depth, drafted by `drafter` (lookup or mtp); None: not predicted
    accept_rate: float | None = None
    drafter: str = "lookup"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Each field is the `colibri plan` flag of its name."""
        return tuple(f.name for f in dataclasses.fields(cls))


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


def _setup(req: PlanRequest, profile) -> Setup:
    geometry = resolve(req.model)
    quant = req.quant or geometry.native_quant
    hw = HardwareView(profile)
    fitted = cal.factors_from_profile(profile)
    section = getattr(profile, "cost_model", None) or {}
    overhead = int(section.get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES)
    # The machine's factors carry over to any model; the router's recall only to the geometry
    # it was measured on (model_facts.py).
    recall, source = recall_for(section, geometry.to_dict())
    factors = dataclasses.replace(fitted or Factors(), lookahead_recall=recall)
    return Setup(geometry, quant, hw, make_routing(req.routing, geometry), factors, fitted is not None,
                 overhead, source)


def _base_config(req: PlanRequest, hw: HardwareView) -> EngineConfig:
    config = EngineConfig.load(req.config) if req.config else EngineConfig()
    if req.budget:
        config = config.replace(ram_budget=req.budget)  # bytes already (argtypes.size)
    elif not config.ram_budget:
        config = config.replace(ram_budget=int(hw.ram_bytes * 0.88))
    return config


def run_plan(req: PlanRequest) -> PlanResult | CalibrationResult:
    profile = load_profile(req.profile)
    if req.calibrate:
        return run_calibrate(req, profile)
    profile = apply_what_if(profile, req.what_if)
    s = _setup(req, profile)
    config = _base_config(req, s.hw)
    run = RunConditions() if req.conditions == "trial" else RunConditions.steady()
    pred = predict(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run, s.overhead)
    policies = ("lru", "lfu", "pinned") if s.routing.kind == "histogram" else ("lru", "lfu")
    ranked = rank(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run, s.overhead, policies)
    prefill = None
    if req.prompt_tokens:
        prefill = predict_prefill(s.geometry, s.quant, config, s.hw, s.routing, s.factors, req.prompt_tokens,
                                  req.cached_tokens, s.overhead)
        if req.cached_tokens and prefill["fits"]:  # what the reuse saves: the whole prompt computed
            whole = predict_prefill(s.geometry, s.quant, config, s.hw, s.routing, s.factors,
                                    req.prompt_tokens + req.cached_tokens, 0, s.overhead)
            prefill["ttft_without_reuse_s"] = whole.get("ttft_s")
    draft = {}
    if req.accept_rate is not None and pred.fits:
        draft = draft_prediction(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run, s.overhead,
                                 req.accept_rate, req.drafter)
    return PlanResult(
        model=s.geometry.to_dict(), quant=s.quant, routing=s.routing.description,
        conditions=req.conditions, what_if=list(req.what_if), calibrated=s.calibrated,
        factors=s.factors.to_dict(), lookahead_recall_source=s.recall_source,
        calibrated_for=calibration_text(getattr(profile, "cost_model", None)),
        profile_routing=routing_for(getattr(profile, "cost_model", None), s.geometry.to_dict()),
        overhead_bytes=s.overhead, config=config.to_dict(),
        prediction=pred.to_dict(),
        best=[{"config": r.config.to_dict(), "prediction": r.prediction.to_dict()} for r in ranked[:req.top]],
        batch=[p.to_dict() for p in predict_batch(s.geometry, s.quant, config, s.hw, s.routing, s.factors, run,
                                                 s.overhead, req.batch)] if req.batch else [],
        draft=draft,
        prefill=prefill,
    )


def run_calibrate(req: PlanRequest, profile) -> CalibrationResult:
    geometry = resolve(req.model)
    quant = req.quant or geometry.native_quant
    hw = HardwareView(profile)
    studies = [cal.load_study(d) for d in req.calibrate]
    study = studies[0]
    overhead = next((s.overhead_bytes for s in studies if s.overhead_bytes), DEFAULT_OVERHEAD_BYTES)
    routing_path = next((s.routing_path for s in studies if s.routing_path is not None), None)
    routing_spec = str(routing_path) if req.routing == "auto" and routing_path is not None else req.routing
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
    section["held_out_by_kind"] = cal.errors_by_kind(rows)
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
    section["fitted_on"]["sources"] = [Path(d).name for d in req.calibrate]
    out = {"calibration": section, "held_out": [{**r, "config": r["config"].to_dict()} for r in rows],
           "profile": os.fspath(req.profile), "test": None}
    if req.test:
        test = cal.load_study(req.test)
        test.overhead_bytes = test.overhead_bytes or overhead
        test_trials = cal.prepare(test, geometry, quant, hw, routing, recall)
        test_rows = cal.predict_rows(test_trials, factors)
        out["test"] = {"source": Path(req.test).name, "summary": cal.error_summary(test_rows),
                       "rows": [{**r, "config": r["config"].to_dict()} for r in test_rows]}
        section["test"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out["test"]["summary"].items()}
    profile.cost_model = section
    save_profile(profile, req.profile)
    return CalibrationResult(**out)
