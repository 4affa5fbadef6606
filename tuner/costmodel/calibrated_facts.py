"""Facts a calibrated profile carries: one model's, keyed by the geometry they were measured on, and
which kinds of config (io mode, cache policy) its held-out error vouches for.

The efficiency factors a calibration fits (eta_io, c_request, ...) describe the machine and the
engine, and carry over to other models. The router-lookahead recall and the routing statistics
describe one model's router: the synthetic demo's lookahead finds ~97% of the next layer's
experts, a real model's router far fewer (the published figure, Colibrì on GLM-5: 71.6%). So the
profile's `cost_model.measured_on` names the geometry they were measured on, and `plan` uses
them only for that geometry; for any other, the published default. It says which.
"""

from __future__ import annotations

import hashlib
import json

from engine.api import EngineConfig

from tuner.costmodel.predict import DEFAULT_LOOKAHEAD_RECALL
from tuner.results.result import GEOMETRY_KEYS  # the same model for these facts as for a best config

PUBLISHED = f"the published default {DEFAULT_LOOKAHEAD_RECALL:.3f} (Colibrì on GLM-5: 71.6% of the true top-8)"


def geometry_key(geometry: dict) -> dict:
    """The identifying part of a geometry dict (ModelGeometry.to_dict() or result.json's)."""
    return {k: geometry.get(k) for k in GEOMETRY_KEYS}


def geometry_hash(geometry: dict) -> str:
    basis = json.dumps(geometry_key(geometry), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def measured_on(geometry: dict, model: str, recall: float | None, routing: str) -> dict:
    """The profile's record of what was measured on which model (cost_model.measured_on)."""
    return {"model": model, "geometry": geometry_key(geometry), "geometry_hash": geometry_hash(geometry),
            "lookahead_recall": recall, "routing": routing}


def recall_for(section: dict | None, geometry: dict) -> tuple[float, str]:
    """(recall to predict with, where it comes from) for a model of `geometry`, given a profile's
    cost_model section (None or {} when the profile was never calibrated)."""
    section = section or {}
    facts = section.get("measured_on")
    stored = (section.get("factors") or {}).get("lookahead_recall")
    if not isinstance(facts, dict) or not isinstance(facts.get("geometry"), dict):
        if stored is not None and stored != DEFAULT_LOOKAHEAD_RECALL:
            return DEFAULT_LOOKAHEAD_RECALL, (f"{PUBLISHED}: the profile's recall {stored:.3f} names no model "
                                              f"geometry (recorded before recall was keyed), so it is not used")
        return DEFAULT_LOOKAHEAD_RECALL, PUBLISHED
    recall = facts.get("lookahead_recall")
    if geometry_key(facts["geometry"]) == geometry_key(geometry):
        if recall is None:
            return DEFAULT_LOOKAHEAD_RECALL, f"{PUBLISHED}: no trial of {facts.get('model')} measured it"
        return float(recall), f"measured on this geometry ({facts.get('model')}): {float(recall):.3f}"
    if recall is None:
        return DEFAULT_LOOKAHEAD_RECALL, PUBLISHED
    return DEFAULT_LOOKAHEAD_RECALL, (f"{PUBLISHED}: the profile's {float(recall):.3f} was measured on "
                                      f"{facts.get('model')}, another geometry")


def routing_for(section: dict | None, geometry: dict) -> str | None:
    """The profile's routing statistics when they were measured on this geometry, else None."""
    facts = (section or {}).get("measured_on")
    if isinstance(facts, dict) and isinstance(facts.get("geometry"), dict) \
            and geometry_key(facts["geometry"]) == geometry_key(geometry):
        return facts.get("routing")
    return None


# --- which kinds of config the calibration vouches for (tuner/search/prediction.py, plan) ---

MIN_TRIALS = 3  # held-out trials of a kind before its error counts as known (one or two is an anecdote)
MAX_ERROR_PCT = 25.0  # median held-out error of a kind above which its picks are not worth a trial
KINDS = ("io_mode", "cache_policy")  # what a config's kind is: both must be calibrated and small


def kind_errors(section: dict | None) -> dict:
    """{'io_mode': {mode: {trials, decode_median_abs_pct_error}}, 'cache_policy': {...}} of a
    profile's cost_model section ({} when it was never calibrated, or calibrated before the
    errors were kept per kind)."""
    held = (section or {}).get("held_out_by_kind")
    return held if isinstance(held, dict) else {}


def trusted(section: dict | None, config: EngineConfig) -> tuple[bool, str]:
    """Whether the calibration's error on this config's kind (io mode, cache policy) is known and small."""
    if not (section or {}).get("factors"):
        return False, "the profile's cost model is not calibrated (`colibri plan --calibrate RUN`): its error is unknown"
    errors = kind_errors(section)
    for kind in KINDS:
        value = getattr(config, kind)
        e = (errors.get(kind) or {}).get(value) or {}
        n, err = int(e.get("trials") or 0), e.get("decode_median_abs_pct_error")
        if n < MIN_TRIALS or err is None:
            return False, f"{kind} {value}: {n} calibration trial(s), its error unknown (needs {MIN_TRIALS})"
        if err > MAX_ERROR_PCT:
            return False, f"{kind} {value}: median error {err:.0f}% on {n} trials (over {MAX_ERROR_PCT:.0f}%)"
    return True, ""


def calibrated_modes(section: dict | None) -> list[str]:
    """The io modes whose figures the profile's calibration vouches for (`plan` prints them)."""
    if not (section or {}).get("factors"):
        return []
    modes = kind_errors(section).get("io_mode") or {}
    return sorted(m for m, e in modes.items() if int(e.get("trials") or 0) >= MIN_TRIALS
                  and e.get("decode_median_abs_pct_error") is not None)




def calibration_text(section: dict | None) -> str:
    """`plan`'s line: which io modes its figures are calibrated for, and with what error."""
    if not (section or {}).get("factors"):
        return "no io mode (the profile was never calibrated: `colibri plan --calibrate RUN`)"
    modes = kind_errors(section).get("io_mode") or {}
    if not modes:
        return "unknown per io mode (calibrated before the errors were kept per io mode: calibrate again)"
    known = calibrated_modes(section)
    parts = [f"{m} ({modes[m]['trials']} trials, median error {modes[m]['decode_median_abs_pct_error']:.0f}%)"
             for m in known]
    others = sorted({"direct", "buffered", "mmap"} - set(known))
    return "; ".join(parts + ([f"not {', '.join(others)} (uncalibrated: their figures are the measured curves "
                               f"as they are)"] if others else []))
