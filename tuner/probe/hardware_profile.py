"""HardwareProfile: what `colibri probe` measured, as dataclasses with a strict JSON form.

Every measured figure is a `Quantity` (value + unit). The unit a field must carry is declared
once, in the field's metadata, and checked on load, so a profile written by hand or by another
tool cannot smuggle MB/s where B/s is meant. Loading rejects unknown keys, missing keys and
wrong types with one line naming the offending path. docs/PROFILE.md documents the schema.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from engine.api import atomic_write_text, read_input
from tuner.probe.probe_errors import ProfileError
from tuner.probe.profile_checks import check_document, check_physics, check_ranges, parse_text
from tuner.base.typed_json import decode, json_type

SCHEMA_VERSION = 1


def _unit(unit: str, **kw):
    return field(metadata={"unit": unit}, **kw)


@dataclass(frozen=True)
class Quantity:
    value: float
    unit: str


@dataclass
class ToolInfo:
    name: str
    version: str


@dataclass
class ProbeRun:
    mode: Literal["quick", "default", "custom"]
    started_utc: str
    duration: Quantity = _unit("s")


@dataclass
class CpuInfo:
    """The CPU: model, cores, NUMA nodes, the flags matmul kernels care about."""

    model: str
    arch: str
    physical_cores: int
    logical_cores: int
    numa_nodes: int
    # Only the flags that matter for matmul kernels (see system.INTERESTING_CPU_FLAGS).
    flags: list[str]


@dataclass
class MemoryInfo:
    """RAM, and the memory cgroup limit this process runs under."""

    total: Quantity = _unit("B")
    available: Quantity = _unit("B")
    # None: no memory cgroup limit in force (or none readable).
    cgroup_limit: Optional[Quantity] = _unit("B")
    cgroup_version: Optional[Literal["v1", "v2"]] = None


@dataclass
class DiskInfo:
    """The disk under the probed directory (no serial numbers)."""

    device: Optional[str]
    transport: str
    rotational: Optional[bool]
    model: Optional[str]
    filesystem: Optional[str]
    free: Quantity = _unit("B")
    total: Quantity = _unit("B")


@dataclass
class SystemInfo:
    os: str
    cpu: CpuInfo
    memory: MemoryInfo
    disk: DiskInfo


StorageRole = Literal["sequential", "curve", "latency_4k", "iops_4k", "buffered"]


@dataclass(frozen=True)
class StoragePoint:
    """One storage job: its access pattern and what it measured."""

    role: StorageRole
    pattern: Literal["read", "randread"]
    request_bytes: int
    queue_depth: int
    direct: bool
    runtime: Quantity = _unit("s")
    bandwidth: Quantity = _unit("B/s")
    iops: Quantity = _unit("IO/s")
    lat_mean: Quantity = _unit("us")
    lat_p50: Quantity = _unit("us")
    lat_p99: Quantity = _unit("us")


@dataclass
class StorageResult:
    """The storage probe: which tool ran the jobs, and every point measured."""

    method: Literal["fio", "fallback"]
    tool: str
    ioengine: str
    points: list[StoragePoint]
    test_file: Quantity = _unit("B")
    runtime_per_job: Quantity = _unit("s")


@dataclass(frozen=True)
class MemoryBandwidthPoint:
    """Memory bandwidth of one operation at one thread count."""

    op: Literal["read", "copy"]
    threads: int
    repeats: int
    buffer: Quantity = _unit("B")
    # copy counts bytes read plus bytes written, as STREAM does.
    bandwidth: Quantity = _unit("B/s")


MatmulDtype = Literal["bf16", "fp32"]  # the dtypes tuner/probe/cpu.py measures


# CpuMatmulPoint and ExpertKernelPoint share their shape and timing fields but stay two
# declarations: a common base class would put those fields first, changing profile.json's key
# order and the loader's first-error path.
@dataclass(frozen=True)
class CpuMatmulPoint:
    """A point of the profile's `cpu_matmul`: dense F.linear throughput of x[m,k] times W[n,k]^T
    at one compute dtype and thread count (tuner/probe/cpu.py)."""

    dtype: MatmulDtype
    m: int
    k: int
    n: int
    threads: int
    calls: int
    throughput: Quantity = _unit("GFLOP/s")
    time_per_call: Quantity = _unit("us")


KernelQuant = Literal["bf16", "int8", "int4"]  # the expert weight formats tuner/probe/kernels.py times
KERNEL_QUANTS = typing.get_args(KernelQuant)  # the one list: the probe, its summary, the cost model


@dataclass(frozen=True)
class ExpertKernelPoint:
    """A point of the profile's `expert_kernels`: one expert projection x[m,k] times W[n,k]^T
    through the kernel the engine runs for its weight format (F.linear for bf16;
    engine/weights/quantized.py's QuantWeight.linear for int8 / int4)."""

    quant: KernelQuant
    kernel: str  # e.g. "F.linear", "aten._weight_int8pack_mm", "dequantize+linear"
    group_size: Optional[int]  # int4's scale group; None otherwise
    m: int
    k: int
    n: int
    threads: int
    calls: int
    throughput: Quantity = _unit("GFLOP/s")
    time_per_call: Quantity = _unit("us")
    # Stored matrix -> kernel operand (QuantWeight.prepare): paid once per expert read.
    prepare_time: Quantity = _unit("us")


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device, and its host-to-device copy bandwidth when measured."""

    index: int
    name: str
    vram: Quantity = _unit("B")
    h2d_bandwidth: Optional[Quantity] = _unit("B/s")


@dataclass
class HardwareProfile:
    schema_version: int
    tool: ToolInfo
    created_utc: str
    fingerprint: str
    probe: ProbeRun
    system: SystemInfo
    storage: StorageResult
    memory_bandwidth: list[MemoryBandwidthPoint]
    cpu_matmul: list[CpuMatmulPoint]
    gpus: list[GpuInfo]
    # Expert-kernel throughput per weight format (tuner/probe/kernels.py). Optional: profiles
    # probed before it existed still load; the cost model then charges int8/int4 at bf16's rate.
    expert_kernels: list[ExpertKernelPoint] = field(default_factory=list, metadata={"optional": True})
    # Written by the tuner (profiles.py), validated there; the probe leaves it empty.
    best_configs: list[dict[str, Any]] = field(default_factory=list)
    # The cost model's fitted efficiency factors for this machine (tuner/costmodel/fit.py
    # validates the content). Optional: profiles written before it existed still load.
    cost_model: dict[str, Any] = field(default_factory=dict, metadata={"optional": True})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "HardwareProfile":
        if not isinstance(data, dict):
            raise ProfileError(f"profile: expected a JSON object, got {json_type(data)}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ProfileError(
                f"profile: schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
        profile = _decode(cls, data, "profile")
        expected = compute_fingerprint(profile.system, profile.gpus)
        if profile.fingerprint != expected:
            raise ProfileError(
                f"profile.fingerprint: {profile.fingerprint!r} does not match the hardware it "
                f"describes ({expected!r}); the profile was edited or is corrupt")
        return profile

    # --- helpers for the cost model and the tuner -------------------------------------------

    def read_bandwidth(self, request_bytes: int, queue_depth: int, direct: bool = True) -> float:
        """Random-read bandwidth in bytes/s at this request size and queue depth.

        Interpolates the measured direct curve linearly in log2(request size), then in
        log2(queue depth); outside the measured range it holds the nearest edge rather than
        extrapolating. Buffered reads were measured at one point only, so the buffered figure is
        the direct curve scaled by the buffered/direct ratio observed at that point.
        """
        if request_bytes <= 0 or queue_depth <= 0:
            raise ValueError("request_bytes and queue_depth must be positive")
        curve = {(p.request_bytes, p.queue_depth): p.bandwidth.value
                 for p in self.storage.points if p.role == "curve" and p.direct}
        if not curve:
            raise ProfileError("profile.storage: no direct random-read curve was measured")
        value = _interpolate_curve(curve, request_bytes, queue_depth)
        if direct:
            return value
        buffered = [p for p in self.storage.points if p.role == "buffered"]
        if not buffered:
            raise ProfileError("profile.storage: no buffered read was measured")
        ref = buffered[0]
        direct_ref = _interpolate_curve(curve, ref.request_bytes, ref.queue_depth)
        return value * (ref.bandwidth.value / direct_ref) if direct_ref > 0 else 0.0

    def storage_point(self, role: str) -> StoragePoint | None:
        return next((p for p in self.storage.points if p.role == role), None)


def _interpolate_curve(curve: dict[tuple[int, int], float], size: int, qd: int) -> float:
    by_qd: dict[int, list[tuple[int, float]]] = {}
    for (s, q), bw in curve.items():
        by_qd.setdefault(q, []).append((s, bw))
    qds = sorted(by_qd)
    at_size = [(q, interp_log2(sorted(by_qd[q]), size)) for q in qds]
    return interp_log2(at_size, qd)


def interp_log2(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise-linear in log2(x) through sorted (x, y) points, clamped at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + t * (y1 - y0)
    raise AssertionError("unreachable: points are sorted")


# --- fingerprint ----------------------------------------------------------------------------

def fingerprint_basis(system: SystemInfo, gpus: list[GpuInfo]) -> dict:
    """The hardware facts that identify a machine class: nothing personal, nothing volatile.

    No hostname, user, paths or serial numbers; RAM in whole GiB because the kernel's total
    moves by a few MiB between boots.
    """
    gib = 1 << 30
    return {
        "cpu_model": system.cpu.model,
        "arch": system.cpu.arch,
        "physical_cores": system.cpu.physical_cores,
        "logical_cores": system.cpu.logical_cores,
        "numa_nodes": system.cpu.numa_nodes,
        "cpu_flags": sorted(system.cpu.flags),
        "ram_gib": round(system.memory.total.value / gib),
        "disk_transport": system.disk.transport,
        "disk_model": system.disk.model,
        "disk_rotational": system.disk.rotational,
        "gpus": [[g.name, round(g.vram.value / gib)] for g in gpus],
    }


def compute_fingerprint(system: SystemInfo, gpus: list[GpuInfo]) -> str:
    canonical = json.dumps(fingerprint_basis(system, gpus), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


# --- files ----------------------------------------------------------------------------------

def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> Path:
    """Write the profile as JSON atomically: a temp file in the same directory, then rename."""
    path = Path(path)
    text = json.dumps(profile.to_dict(), indent=2) + "\n"
    if not path.parent.is_dir():
        raise ProfileError(f"cannot write {path}: directory {path.parent} does not exist")
    try:
        atomic_write_text(path, text)
    except OSError as exc:
        raise ProfileError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    """The strict loader every command that reads a profile uses (plan, tune --profile, a run's
    profile.json, and profile import/show/diff under their shared-profile checks): a regular
    file under the profile size cap, JSON with no NaN or duplicate keys, short control-free
    strings, the typed schema with its units and fingerprint, plausible ranges and the physical
    rules the cost model relies on (tuner/probe/profile_checks.py)."""
    path = Path(path)
    data = parse_text(read_input(path, "profile", ProfileError), str(path))
    if isinstance(data, dict) and "identity" in data:
        # A shared profile exported with --include-identity (tuner/share/profiles.py): who and where
        # it came from is allowed, never required, and nothing the tuner reads.
        if not isinstance(data["identity"], dict):
            raise ProfileError(f"{path}: identity must be an object")
        data = {k: v for k, v in data.items() if k != "identity"}
    try:
        check_document(data, "profile", 0)
        profile = HardwareProfile.from_dict(data)
        check_ranges(data)
        check_physics(data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return profile


# --- strict decoding (tuner/base/typed_json.py), with the profile's own rules ------------------------

def _decode(tp: Any, data: Any, path: str) -> Any:
    return decode(tp, data, path, ProfileError, _check_units_and_signs)


def _check_units_and_signs(cls: type, values: dict, path: str, unit: str | None) -> dict:
    """A Quantity carries the unit its field declares and is never negative; so are counts."""
    hints = typing.get_type_hints(cls)
    if cls is Quantity:
        if unit is not None and values["unit"] != unit:
            raise ProfileError(f"{path}.unit: expected {unit!r}, got {values['unit']!r}")
        if values["value"] < 0:
            raise ProfileError(f"{path}.value: must not be negative, got {values['value']}")
        values["value"] = float(values["value"])
    else:
        bad = next((n for n in values if hints[n] is int and values[n] < 0), None)
        if bad is not None:
            raise ProfileError(f"{path}.{bad}: must not be negative, got {values[bad]}")
    return values
