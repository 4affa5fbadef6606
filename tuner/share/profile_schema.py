"""Strict validation of a shareable profile (docs/PROFILE.md, "Shared profiles").

A shared profile comes from a stranger, so everything is checked before any of it is used or
printed: the file's size; JSON with no NaN, no duplicate keys, bounded nesting; every string
short and free of control characters (a terminal escape in a CPU name would rewrite the
screen of whoever runs `colibri profile show`); array lengths; the hardware part through the
probe's own strict decoder (types, units, fingerprint) plus plausible ranges; and every
best_configs entry through the same strict decoder (tuner/base/typed_json.py) against the
SharedEntry dataclasses below (types, required keys, bounds, patterns), its config through
EngineConfig's own validation, its geometry hash recomputed. The first violation is one
ProfileError line naming its path.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Literal, Optional

from engine.api import ConfigError, EngineConfig
from tuner.base.typed_json import decode, rules
from tuner.probe.probe_errors import ProfileError
from tuner.probe.hardware_profile import HardwareProfile
from tuner.results.quant_rundir import QUANT_LABEL_RE  # a stored level: only the group sizes the converter writes
from tuner.results.result import BEST_CONFIG_SCHEMA, GEOMETRY_KEYS, Objective
# The checks every profile gets, shared or local, live with the probe's schema; re-exported here.
from tuner.probe.profile_checks import (CONTROL_RE, HARDWARE_RANGES, MAX_ARRAY, MAX_DEPTH,  # noqa: F401
                                        MAX_FILE_BYTES, MAX_STRING, check_document, check_physics,
                                        check_ranges, parse_text)

MAX_ENTRIES = 256
HASH_RE = re.compile(r"^sha256:[0-9a-f]{16}$")
UTC_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
SCALE = {"tok/s": (0, 1e9), "s": (0, 1e7), "B": (0, 2 ** 52), "GB/s": (0, 1e5), "share": (0, 1),
         "req/s": (0, 1e9)}  # plausible
COUNT = (0, 10 ** 6)


# --- a best_configs entry, as dataclasses: the one validator (tuner/base/typed_json.py) checks it ---

def _num(unit: str, **meta):
    return field(default=None, metadata=rules(bounds=SCALE[unit], unit=unit, **meta))


@dataclass
class SharedFigures:
    """A best config's figures: its confirmed medians and spread (result.json's Figures) and,
    `trial=`, what explains them, copied from its trial's trials.csv column of that name (the
    column registry, tuner/results/columns.py). Every key is required; null: not measured."""

    decode_tok_s: Optional[float] = _num("tok/s")
    ttft_s: Optional[float] = _num("s")
    decode_min: Optional[float] = _num("tok/s")
    decode_max: Optional[float] = _num("tok/s")
    decode_stdev: Optional[float] = _num("tok/s")
    ttft_min: Optional[float] = _num("s")
    ttft_max: Optional[float] = _num("s")
    measurements: Optional[int] = field(default=None, metadata=rules(bounds=COUNT))
    samples: Optional[int] = field(default=None, metadata=rules(bounds=COUNT))
    unconfirmed: bool = False  # true: a search figure, not re-measured
    bytes_read_per_token: Optional[float] = _num("B", trial="bytes_read_per_token")
    read_gbps: Optional[float] = _num("GB/s", trial="read_gbps")
    io_stall_fraction: Optional[float] = _num("share", trial="io_stall_fraction")
    hit_rate_ram: Optional[float] = _num("share", trial="hit_rate_ram")
    peak_bytes: Optional[float] = _num("B", trial="cgroup_peak_bytes")  # a trials.csv number
    # tune --objective serve's figure (added with it; an older entry lacks it): requests of the trace
    # within its SLOs per second (the entry's workload names the trace by hash and the SLOs).
    goodput_rps: Optional[float] = _num("req/s", optional=True)


@dataclass
class SharedConditions:
    """What the figures were measured under (result.json's conditions, less paths and machine)."""

    cold: bool
    tokens: int = field(metadata=rules(bounds=(1, 10 ** 6)))
    repeats: int = field(metadata=rules(bounds=(1, 10 ** 4)))
    prompt_tokens: int = field(metadata=rules(bounds=(0, 10 ** 7)))
    seed: Optional[int] = field(metadata=rules(bounds=(0, 2 ** 63)))
    min_ctx: Optional[int] = field(metadata=rules(bounds=(1, 1 << 22)))
    cgroup_enforced: Optional[bool]
    confirmation_rounds: Optional[int] = field(metadata=rules(bounds=(0, 10 ** 4)))
    trials: Optional[int] = field(metadata=rules(bounds=(0, 10 ** 7)))
    feasible: Optional[int] = field(metadata=rules(bounds=(0, 10 ** 7)))
    sampler: Optional[str]
    wall_seconds: Optional[float] = field(metadata=rules(bounds=(0, 1e8)))


@dataclass
class SharedQuality:
    kl_mean: Optional[float] = field(metadata=rules(bounds=(0, 1e6)))
    top1_agreement: Optional[float] = field(metadata=rules(bounds=(0, 1)))
    perplexity: Optional[float] = field(metadata=rules(bounds=(0, 1e9)))
    reference: Optional[str]


@dataclass
class Tool:
    name: str
    version: str
    engine_version: Optional[str]
    git_commit: Optional[str]


@dataclass
class SharedLengths:
    min: int = field(metadata=rules(bounds=(0, 1 << 22)))
    median: float = field(metadata=rules(bounds=(0, 1 << 22)))
    max: int = field(metadata=rules(bounds=(0, 1 << 22)))
    total: int = field(metadata=rules(bounds=(0, 1 << 40)))


@dataclass
class SharedWorkload:
    """The workload an entry was tuned for: its lengths and a hash of the tokenized prompts, never text."""

    kind: Literal["steady", "fixed", "prompts", "trace"]
    requests: int = field(metadata=rules(bounds=(1, 1 << 20)))
    prompt_tokens: SharedLengths
    max_new_tokens: SharedLengths
    sha256: Optional[str] = field(metadata=rules(pattern=HASH_RE))
    # The steady workload's (added with it; an older entry lacks them): what `bench --steady` needs.
    temperature: Optional[float] = field(default=None, metadata=rules(bounds=(0, 100), optional=True))
    top_p: Optional[float] = field(default=None, metadata=rules(bounds=(0, 1), optional=True))
    seed: Optional[int] = field(default=None, metadata=rules(bounds=(0, 2 ** 63), optional=True))
    cycle_tokens: Optional[float] = field(default=None, metadata=rules(bounds=(0, 1 << 30), optional=True))
    # A request trace's (tune --objective serve; added with it): the SLOs its goodput counts against,
    # its span from first to last arrival, its sequences (n summed).
    slo_ttft_s: Optional[float] = field(default=None, metadata=rules(bounds=SCALE["s"], optional=True))
    slo_tpot_s: Optional[float] = field(default=None, metadata=rules(bounds=SCALE["s"], optional=True))
    span_s: Optional[float] = field(default=None, metadata=rules(bounds=SCALE["s"], optional=True))
    sequences: Optional[int] = field(default=None, metadata=rules(bounds=(1, 1 << 30), optional=True))


# GEOMETRY_KEYS' sizes, plus the architecture's name.
Geometry = make_dataclass("Geometry", [("model_type", str)] + [
    (k, int, field(metadata=rules(bounds=(1, 1 << 24)))) for k in GEOMETRY_KEYS if k != "model_type"])


@dataclass
class SharedEntry:
    """One best_configs entry of a shared profile (colibri.best_config/1)."""

    schema: Literal["colibri.best_config/1"]
    model: str
    geometry: Geometry
    geometry_hash: str = field(metadata=rules(pattern=HASH_RE))
    quant: str = field(metadata=rules(pattern=QUANT_LABEL_RE))
    compute_dtype: str
    ram_budget: int = field(metadata=rules(bounds=(1 << 20, 1 << 52)))
    objective: Objective
    config: dict[str, Any]  # checked by EngineConfig's own validation (check_entry)
    figures: SharedFigures
    baseline_figures: Optional[SharedFigures]
    gain_over_baseline: Optional[float] = field(metadata=rules(bounds=(-1, 1e6)))
    quality: Optional[SharedQuality]
    conditions: SharedConditions
    tool: Tool
    created_utc: str = field(metadata=rules(pattern=UTC_RE))
    # Added later: an entry written before may lack them (optional).
    defaults_figures: Optional[SharedFigures] = field(default=None, metadata={"optional": True})
    gain_over_defaults: Optional[float] = field(default=None, metadata=rules(bounds=(-1, 1e6), optional=True))
    workload: Optional[SharedWorkload] = field(default=None, metadata={"optional": True})


@dataclass
class Identity:
    """What identifies a person or a box: only with `profile export --include-identity`."""

    hostname: Optional[str]
    user: Optional[str]
    model_dirs: list[str]


assert typing.get_args(typing.get_type_hints(SharedEntry)["schema"]) == (BEST_CONFIG_SCHEMA,)  # one schema id


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
        decode(Identity, identity, "profile.identity", ProfileError)
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
    decode(SharedEntry, entry, path, ProfileError)
    try:
        EngineConfig.from_dict(entry["config"], source=f"{path}.config")
    except ConfigError as exc:
        raise ProfileError(str(exc)) from None
    if "/" in entry["model"] or "\\" in entry["model"]:
        raise ProfileError(f"{path}.model: a model name, not a path")
    if entry["geometry_hash"] != geometry_hash(entry["geometry"]):
        raise ProfileError(f"{path}.geometry_hash: does not match the geometry it describes")
