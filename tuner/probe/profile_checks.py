"""The checks every hardware profile gets before anything uses or prints it, whether it is
this machine's own (plan, tune --profile, a run's profile.json) or a stranger's (profile
import/show/diff, which add the best_configs checks of tuner/share/profile_schema.py).

Why the local loader is strict too: `plan` read profiles laxly, so a 50 MB file was parsed, a
zero storage curve printed inf/nan, and a memory bandwidth of 0 or a cost-model eta of 0
divided by zero. Here: the file's size and strict JSON (no NaN, no duplicate keys, bounded
nesting); short control-free strings anywhere; plausible ranges of the hardware figures; and
the physical rules the cost model relies on (a direct random-read curve that exists and is
positive, positive memory bandwidth and throughputs, p50 <= p99, factors in their ranges).
The first violation is one ProfileError line naming its path.
"""

from __future__ import annotations

import math
import re

from engine.api import ColibriError, loads_limited
from tuner.probe.probe_errors import ProfileError

MAX_FILE_BYTES = 1 << 20  # engine/base/inputs.py LIMITS['profile']
MAX_DEPTH = 12
MAX_STRING = 256
MAX_ARRAY = 512
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# Plausible ranges of the hardware figures: far beyond any real machine, far below nonsense.
HARDWARE_RANGES = {
    "system.cpu.physical_cores": (1, 65536), "system.cpu.logical_cores": (1, 65536),
    "system.cpu.numa_nodes": (1, 1024), "system.memory.total": (1 << 26, 1 << 52),
    "storage.points[].request_bytes": (512, 1 << 30), "storage.points[].queue_depth": (1, 65536),
    "storage.points[].bandwidth": (0, 1e13), "storage.points[].iops": (0, 1e10),
    "storage.points[].lat_p99": (0, 1e9), "memory_bandwidth[].bandwidth": (0, 1e14),
    "cpu_matmul[].throughput": (0, 1e8), "expert_kernels[].throughput": (0, 1e8),
    "expert_kernels[].prepare_time": (0, 1e9), "gpus[].vram": (0, 1 << 50),
}

# The cost model's stored factors (cost_model.factors, fitted by tuner/costmodel/fit.py): the
# physical ranges, wider than the fit's own bounds. Outside them a prediction divides by zero
# (eta 0), goes negative (negative overheads) or is meaningless (a recall of 5).
FACTOR_RANGES = {"eta_io": (1e-3, 100.0), "eta_compute": (1e-3, 100.0), "overlap": (0.0, 1.0),
                 "c_request": (0.0, 1.0), "c_layer": (0.0, 1.0), "c_page_buffered": (0.0, 1e-5),
                 "c_page_mmap": (0.0, 1e-5), "lookahead_recall": (0.0, 1.0)}


def parse_text(raw: bytes, where: str):
    """Strict JSON of a profile: size, UTF-8, nesting, no NaN/Infinity, no duplicate keys."""
    if len(raw) > MAX_FILE_BYTES:
        raise ProfileError(f"{where}: {len(raw)} bytes is over the {MAX_FILE_BYTES}-byte limit for a profile")
    return loads_limited(raw, where, max_bytes=MAX_FILE_BYTES, max_depth=MAX_DEPTH + 2, error=ProfileError,
                         unique_keys=True, finite=True)


def check_document(value, path: str, depth: int) -> None:
    """Sizes and characters anywhere in the document (keys included)."""
    if depth > MAX_DEPTH:
        raise ProfileError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ProfileError(f"{path}: string of {len(value)} characters, at most {MAX_STRING}")
        if CONTROL_RE.search(value):
            raise ProfileError(f"{path}: control characters are not allowed in strings")
    elif isinstance(value, list):
        if len(value) > MAX_ARRAY:
            raise ProfileError(f"{path}: array of {len(value)} items, at most {MAX_ARRAY}")
        for i, v in enumerate(value):
            check_document(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_document(k, f"{path} key", depth + 1)
            check_document(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ProfileError(f"{path}: NaN and infinity are not allowed")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2 ** 63:
        raise ProfileError(f"{path}: integer out of range")


def check_ranges(hardware: dict) -> None:
    for dotted, (lo, hi) in HARDWARE_RANGES.items():
        for path, value in _select(hardware, dotted.split("."), "profile"):
            v = value.get("value") if isinstance(value, dict) else value
            if v is not None and not (lo <= v <= hi):
                raise ProfileError(f"{path}: {v} is outside the plausible range [{lo:g}, {hi:g}]")


def check_physics(hardware: dict) -> None:
    """What the cost model divides by or interpolates in is physical. Run after the typed
    decode (HardwareProfile.from_dict), so every field has its type."""
    points = (hardware.get("storage") or {}).get("points") or []
    if not any(p.get("role") == "curve" and p.get("direct") for p in points):
        raise ProfileError("profile.storage.points: no direct random-read curve point (role 'curve'); "
                           "the cost model needs the curve")
    for i, p in enumerate(points):
        where = f"profile.storage.points[{i}]"
        for key in ("request_bytes", "queue_depth"):
            if p[key] <= 0:
                raise ProfileError(f"{where}.{key}: must be positive, got {p[key]}")
        if p["bandwidth"]["value"] <= 0:
            raise ProfileError(f"{where}.bandwidth: must be positive, got {p['bandwidth']['value']}")
        if p["lat_p50"]["value"] > p["lat_p99"]["value"]:
            raise ProfileError(f"{where}: lat_p50 {p['lat_p50']['value']} is above lat_p99 {p['lat_p99']['value']}")
    if not hardware.get("memory_bandwidth"):
        raise ProfileError("profile.memory_bandwidth: no measurement (the cost model needs one)")
    for name, key in (("memory_bandwidth", "bandwidth"), ("cpu_matmul", "throughput"),
                      ("expert_kernels", "throughput")):
        for i, m in enumerate(hardware.get(name) or []):
            if m[key]["value"] <= 0:
                raise ProfileError(f"profile.{name}[{i}].{key}: must be positive, got {m[key]['value']}")
    section = hardware.get("cost_model") or {}
    if section:
        if not isinstance(section.get("factors"), dict):
            raise ProfileError("profile.cost_model: expected a 'factors' object")
        check_factors(section["factors"], "profile.cost_model.factors")


def check_factors(factors: dict, where: str, error: type[ColibriError] = ProfileError) -> None:
    """Every stored factor known, a finite number, inside its physical range (FACTOR_RANGES)."""
    for key, value in factors.items():
        if key not in FACTOR_RANGES:
            raise error(f"{where}: unknown factor {key!r} (known: {', '.join(FACTOR_RANGES)})")
        lo, hi = FACTOR_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not lo <= value <= hi:
            raise error(f"{where}.{key}: {value!r} is outside its physical range [{lo:g}, {hi:g}]")


def _select(node, parts: list[str], path: str):
    if not parts:
        yield path, node
        return
    head, rest = parts[0], parts[1:]
    many = head.endswith("[]")
    key = head[:-2] if many else head
    if not isinstance(node, dict) or key not in node:
        return
    child = node[key]
    if many:
        for i, item in enumerate(child if isinstance(child, list) else []):
            yield from _select(item, rest, f"{path}.{key}[{i}]")
    else:
        yield from _select(child, rest, f"{path}.{key}")
