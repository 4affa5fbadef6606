"""Strict validation of a shareable profile (docs/PROFILE.md, "Shared profiles").

A shared profile comes from a stranger, so everything is checked before any of it is used or
printed: the file's size; JSON with no NaN, no duplicate keys, bounded nesting; every string
short and free of control characters (a terminal escape in a CPU name would rewrite the
screen of whoever runs `colibri profile show`); array lengths; the hardware part through the
probe's own strict decoder (types, units, fingerprint) plus plausible ranges; and every
best_configs entry against ENTRY_SPEC, its config through EngineConfig's own validation, its
geometry hash recomputed. The first violation is one ProfileError line naming its path.
"""

from __future__ import annotations

import hashlib
import json
import re

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from tuner.probe.errors import ProfileError
from tuner.probe.hardware_profile import HardwareProfile
from tuner.results.quant_rundir import QUANT_LABEL_RE  # a stored level: only the group sizes the converter writes
from tuner.results.result import BEST_CONFIG_SCHEMA, GEOMETRY_KEYS, OBJECTIVES
# The checks every profile gets, shared or local, live with the probe's schema; re-exported here.
from tuner.probe.profile_checks import (CONTROL_RE, HARDWARE_RANGES, MAX_ARRAY, MAX_DEPTH,  # noqa: F401
                                        MAX_FILE_BYTES, MAX_STRING, check_document, check_physics,
                                        check_ranges, parse_text)

MAX_ENTRIES = 256
HASH_RE = re.compile(r"^sha256:[0-9a-f]{16}$")
UTC_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")

# Entry spec: key → (type, nullable, range or choices). "figures" dicts share FIGURES.
NUM, INT, STR, BOOL = "number", "integer", "string", "boolean"
FIGURES = {k: (NUM, True, (0, 1e9)) for k in ("decode_tok_s", "decode_min", "decode_max", "decode_stdev")}
FIGURES.update({k: (NUM, True, (0, 1e7)) for k in ("ttft_s", "ttft_min", "ttft_max")})  # seconds
FIGURES.update({k: (NUM, True, (0, 2 ** 52)) for k in ("bytes_read_per_token", "peak_bytes")})
FIGURES.update({k: (NUM, True, (0, 1)) for k in ("io_stall_fraction", "hit_rate_ram")})
FIGURES.update({"read_gbps": (NUM, True, (0, 1e5))})
FIGURES.update({"measurements": (INT, True, (0, 10 ** 6)), "samples": (INT, True, (0, 10 ** 6)),
                "unconfirmed": (BOOL, False, None)})  # true: a search figure, not re-measured
CONDITIONS = {"cold": (BOOL, False, None), "tokens": (INT, False, (1, 10 ** 6)), "repeats": (INT, False, (1, 10 ** 4)),
              "prompt_tokens": (INT, False, (0, 10 ** 7)), "seed": (INT, True, (0, 2 ** 63)),
              "min_ctx": (INT, True, (1, 1 << 22)), "cgroup_enforced": (BOOL, True, None),
              "confirmation_rounds": (INT, True, (0, 10 ** 4)), "trials": (INT, True, (0, 10 ** 7)),
              "feasible": (INT, True, (0, 10 ** 7)), "sampler": (STR, True, None),
              "wall_seconds": (NUM, True, (0, 1e8))}
QUALITY = {"kl_mean": (NUM, True, (0, 1e6)), "top1_agreement": (NUM, True, (0, 1)),
           "perplexity": (NUM, True, (0, 1e9)), "reference": (STR, True, None)}
TOOL = {"name": (STR, False, None), "version": (STR, False, None), "engine_version": (STR, True, None),
        "git_commit": (STR, True, None)}
LENGTHS = {"min": (INT, False, (0, 1 << 22)), "median": (NUM, False, (0, 1 << 22)), "max": (INT, False, (0, 1 << 22)),
           "total": (INT, False, (0, 1 << 40))}
# The workload an entry was tuned for: its lengths and a hash of the tokenized prompts, never text.
WORKLOAD = {"kind": (STR, False, ("fixed", "prompts")), "requests": (INT, False, (1, 1 << 20)),
            "prompt_tokens": (LENGTHS, False, None), "max_new_tokens": (LENGTHS, False, None),
            "sha256": (STR, True, HASH_RE)}
GEOMETRY = {k: (INT, False, (1, 1 << 24)) for k in GEOMETRY_KEYS if k != "model_type"}
GEOMETRY["model_type"] = (STR, False, None)
ENTRY_SPEC = {
    "schema": (STR, False, (BEST_CONFIG_SCHEMA,)), "model": (STR, False, None), "geometry": (GEOMETRY, False, None),
    "geometry_hash": (STR, False, HASH_RE), "quant": (STR, False, QUANT_LABEL_RE), "compute_dtype": (STR, False, None),
    "ram_budget": (INT, False, (1 << 20, 1 << 52)),
    "objective": (STR, False, OBJECTIVES),
    "config": ("config", False, None), "figures": (FIGURES, False, None), "baseline_figures": (FIGURES, True, None),
    "gain_over_baseline": (NUM, True, (-1, 1e6)), "quality": (QUALITY, True, None),
    "conditions": (CONDITIONS, False, None), "tool": (TOOL, False, None), "created_utc": (STR, False, UTC_RE),
    # Added later: an entry written before may lack them (ENTRY_OPTIONAL).
    "defaults_figures": (FIGURES, True, None), "gain_over_defaults": (NUM, True, (-1, 1e6)),
    "workload": (WORKLOAD, True, None),
}
ENTRY_OPTIONAL = ("defaults_figures", "gain_over_defaults", "workload")
IDENTITY = {"hostname": (STR, True, None), "user": (STR, True, None), "model_dirs": ("strings", False, None)}


def geometry_hash(geometry: dict) -> str:
    basis = json.dumps({k: geometry.get(k) for k in GEOMETRY_KEYS}, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def validate_shared(data) -> "tuple[object, list[dict], dict | None]":
    """→ (HardwareProfile, best_configs entries, identity or None); ProfileError on any violation."""
    if not isinstance(data, dict):
        raise ProfileError("profile: expected a JSON object")
    check_document(data, "profile", 0)
    identity = data.get("identity")
    if identity is not None or "identity" in data:
        check_spec(identity, IDENTITY, "profile.identity")
    hardware = {k: v for k, v in data.items() if k != "identity"}
    entries = hardware.get("best_configs")
    if isinstance(entries, list) and len(entries) > MAX_ENTRIES:
        raise ProfileError(f"profile.best_configs: {len(entries)} entries, at most {MAX_ENTRIES}")
    profile = HardwareProfile.from_dict(hardware)
    check_ranges(hardware)
    check_physics(hardware)
    for i, entry in enumerate(profile.best_configs):
        check_entry(entry, f"profile.best_configs[{i}]")
    return profile, profile.best_configs, identity


def check_entry(entry: dict, path: str) -> None:
    check_spec(entry, ENTRY_SPEC, path, optional=ENTRY_OPTIONAL)
    try:
        EngineConfig.from_dict(entry["config"], source=f"{path}.config")
    except ConfigError as exc:
        raise ProfileError(str(exc)) from None
    if "/" in entry["model"] or "\\" in entry["model"]:
        raise ProfileError(f"{path}.model: a model name, not a path")
    if entry["geometry_hash"] != geometry_hash(entry["geometry"]):
        raise ProfileError(f"{path}.geometry_hash: does not match the geometry it describes")


def check_spec(value, spec: dict, path: str, optional: tuple[str, ...] = ()) -> None:
    """`optional`: keys added to the spec later, which older documents may lack."""
    if not isinstance(value, dict):
        raise ProfileError(f"{path}: expected an object, got {_kind(value)}")
    unknown = sorted(set(value) - set(spec))
    if unknown:
        raise ProfileError(f"{path}: unknown key {unknown[0]!r}")
    for key, (kind, nullable, rule) in spec.items():
        if key not in value:
            if key in optional:
                continue
            raise ProfileError(f"{path}: missing key {key!r}")
        _check_value(value[key], kind, nullable, rule, f"{path}.{key}")


def _check_value(v, kind, nullable, rule, path: str) -> None:
    if v is None:
        if nullable:
            return
        raise ProfileError(f"{path}: must not be null")
    if isinstance(kind, dict):
        return check_spec(v, kind, path)
    if kind == "config":
        if not isinstance(v, dict):
            raise ProfileError(f"{path}: expected an object, got {_kind(v)}")
        return
    if kind == "strings":
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ProfileError(f"{path}: expected an array of strings")
        return
    ok = {INT: isinstance(v, int) and not isinstance(v, bool),
          NUM: isinstance(v, (int, float)) and not isinstance(v, bool),
          STR: isinstance(v, str), BOOL: isinstance(v, bool)}[kind]
    if not ok:
        raise ProfileError(f"{path}: expected {kind}, got {_kind(v)}")
    if isinstance(rule, tuple) and kind in (INT, NUM) and not (rule[0] <= v <= rule[1]):
        raise ProfileError(f"{path}: {v} is outside [{rule[0]:g}, {rule[1]:g}]")
    if isinstance(rule, tuple) and kind == STR and v not in rule:
        raise ProfileError(f"{path}: {v!r} is not one of {', '.join(map(repr, rule))}")
    if isinstance(rule, re.Pattern) and not rule.match(v):
        raise ProfileError(f"{path}: {v!r} is not of the form {rule.pattern}")


def _kind(v) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)
