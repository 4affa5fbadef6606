"""The cost model inside a tune: a prediction beside every trial, and warm starts only where it is known to be right.

    predictor = Predictor.for_run(session)      # once, after the calibration trial
    attrs["predicted_decode_tok_s"] = predictor.decode(config)   # every measured trial
    trusted(section, config)                     # (True, "") or (False, why): may it seed the study?
    cost_model_run(trials, state)                # result.json's cost_model: the error on this run

Why the gate: P4's 13% median error holds for the configs the model was calibrated near. In a
fresh `make tune` it enqueued three mmap configs each "predicted 10 tok/s" that measured 0.4-0.6
tok/s (issue 43): three trials, over 3 of 15 minutes, on an io mode no trial had ever calibrated.
So a predicted config is enqueued only when the profile's calibration (`plan --calibrate`) has
held-out trials of its io mode and of its cache policy and their median error is small; an
uncalibrated profile enqueues none, and the log says why.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from engine.api import EngineConfig
from tuner.costmodel.calibrated_facts import KINDS, recall_for, trusted  # noqa: F401  (trusted: warm_start's)
from tuner.costmodel.fit import factors_from_profile
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.model_geometry import from_model_dir
from tuner.costmodel.predict import Factors, RunConditions, predict
from tuner.costmodel.routing_model import make_routing
from tuner.costmodel.serve_model import predict_goodput
from tuner.results.result import CostModelRun, ModeError

if TYPE_CHECKING:
    from tuner.search.setup import TuneSession


class Predictor:
    """The cost model's decode figure for a config of this run (the profile's factors, or the
    measured curves as they are), made before the config is measured."""

    def __init__(self, geometry, routing, hw, factors, cond, overhead: int):
        self.geometry, self.routing, self.hw, self.factors, self.cond = geometry, routing, hw, factors, cond
        self.overhead = overhead

    @classmethod
    def for_run(cls, session: TuneSession) -> "Predictor | None":
        if not session.facts.has_experts:
            return None
        try:
            geometry = from_model_dir(session.model_dir)
            recall, _ = recall_for(getattr(session.profile, "cost_model", None), geometry.to_dict())
            factors = dataclasses.replace(factors_from_profile(session.profile) or Factors(),
                                          lookahead_recall=recall)
            return cls(geometry, make_routing(session.space.routing_histogram or "auto", geometry),
                       HardwareView(session.profile), factors, run_conditions(session),
                       session.space.overhead_bytes)
        except Exception as exc:  # a prediction is evidence, never a reason to stop a tune
            session.log(f"cost model: no predictions this run ({type(exc).__name__}: {exc})")
            return None

    def goodput(self, config: EngineConfig, trace: list, slo_ttft: float | None, slo_tpot: float | None) -> float | None:
        """tune --objective serve: the config's goodput on the trace, from the scheduler simulated with the
        predicted step times (tuner/costmodel/serve_model.py); evidence beside the measured one, never a warm start."""
        try:
            return predict_goodput(self.geometry, self.geometry.native_quant, config, self.hw, self.routing, trace,
                                   slo_ttft, slo_tpot, self.factors, self.overhead)
        except Exception:
            return None

    def decode(self, config: EngineConfig) -> float | None:
        try:
            p = predict(self.geometry, self.geometry.native_quant, config, self.hw, self.routing, self.factors,
                        self.cond, self.overhead)
        except Exception:
            return None
        return round(p.decode_tok_s, 4) if p.fits and p.decode_tok_s else None


def run_conditions(session: TuneSession) -> RunConditions:
    """The trials' measurement as the cost model's RunConditions: the steady workload's prompts
    differ (no replay); the fixed prompt repeats (replay)."""
    w, o = session.workload_info, session.opts
    return RunConditions(prompt_tokens=max(1, round(w.prompt_tokens.median)),
                         tokens=max(1, round(w.max_new_tokens.median)), repeats=o.repeats, cold=o.cold,
                         replay=w.kind != "steady")


def _errors(pairs: list[tuple[float, float]]) -> ModeError:
    errs = [abs(p - m) / m * 100 for p, m in pairs if m]
    return ModeError(trials=len(errs), median_abs_pct_error=round(statistics.median(errs), 2) if errs else None)


def cost_model_run(trials, state: dict | None) -> CostModelRun | None:
    """Predicted vs measured decode over this run's measured, feasible trials: the median error, per
    io mode and per cache policy."""
    if state is None:
        return None
    rows = []
    for t in trials:
        a = t.user_attrs
        if a.get("status") == "ok" and a.get("duplicate_of") is None and a.get("predicted_decode_tok_s") \
                and a.get("decode_tok_s"):
            rows.append((a.get("config") or {}, a["predicted_decode_tok_s"], a["decode_tok_s"]))
    by = {kind: {} for kind in KINDS}
    for kind in KINDS:
        for value in sorted({str(c.get(kind)) for c, _, _ in rows}):
            by[kind][value] = _errors([(p, m) for c, p, m in rows if str(c.get(kind)) == value])
    overall = _errors([(p, m) for _, p, m in rows])
    return CostModelRun(calibrated=bool(state.get("calibrated")), trials=overall.trials,
                        median_abs_pct_error=overall.median_abs_pct_error, by_io_mode=by["io_mode"],
                        by_cache_policy=by["cache_policy"], warm_starts=int(state.get("warm_starts") or 0),
                        warm_start_note=str(state.get("note") or ""))
