"""HardwareProfile: JSON round trip, strict validation, fingerprint, read_bandwidth."""

import copy
import json
import math
import os

import pytest

from tuner.probe.probe_errors import ProfileError
from tuner.probe.hardware_profile import (
    SCHEMA_VERSION, CpuInfo, DiskInfo, GpuInfo, HardwareProfile, ExpertKernelPoint, CpuMatmulPoint,
    MemoryBandwidthPoint, MemoryInfo, ProbeRun, Quantity, StoragePoint, StorageResult, SystemInfo, ToolInfo,
    compute_fingerprint, fingerprint_basis, load_profile, save_profile,
)

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
QDS = (1, 4, 16)


def bw_of(size: int, qd: int) -> float:
    """A made-up but monotone curve: easy to check interpolation against."""
    return 1e8 * math.log2(size / (32 * KiB)) * (1 + math.log2(qd))


def point(role, pattern, size, qd, bw, direct=True) -> StoragePoint:
    return StoragePoint(
        role=role, pattern=pattern, request_bytes=size, queue_depth=qd, direct=direct,
        runtime=Quantity(1.0, "s"), bandwidth=Quantity(bw, "B/s"),
        iops=Quantity(bw / size, "IO/s"), lat_mean=Quantity(100.0, "us"),
        lat_p50=Quantity(90.0, "us"), lat_p99=Quantity(400.0, "us"))


def kernel_point(quant, m, k, n, gflops, threads=1, kernel=None, prepare_us=0.0) -> ExpertKernelPoint:
    kernel = kernel or {"bf16": "F.linear", "int8": "aten._weight_int8pack_mm",
                        "int4": "aten._weight_int4pack_mm_for_cpu"}[quant]
    return ExpertKernelPoint(quant=quant, kernel=kernel, group_size=64 if quant == "int4" else None, m=m, k=k, n=n,
                       threads=threads, calls=100, throughput=Quantity(gflops, "GFLOP/s"),
                       time_per_call=Quantity(2.0 * m * k * n / gflops / 1e3, "us"),
                       prepare_time=Quantity(prepare_us, "us"))


# A made-up kernel table: int8 at half and int4 at a quarter of bf16's rate, the large shape
# twice the small one's, 4 rows three times 1 row's.
KERNEL_RATES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5}


def make_kernels() -> list:
    return [kernel_point(q, m, k, n, rate * (2 if k > 1024 else 1) * (3 if m == 4 else 1),
                         prepare_us=5.0 if q != "bf16" else 0.0)
            for q, rate in KERNEL_RATES.items() for (k, n) in ((1024, 512), (6144, 2048)) for m in (1, 4)]


def make_profile(curve=True, buffered_bw=None, kernels=False) -> HardwareProfile:
    system = SystemInfo(
        os="Linux 6.1",
        cpu=CpuInfo(model="Test CPU", arch="x86_64", physical_cores=8, logical_cores=16,
                    numa_nodes=1, flags=["avx2", "fma"]),
        memory=MemoryInfo(total=Quantity(64.0 * (1 << 30), "B"),
                          available=Quantity(60.0 * (1 << 30), "B"),
                          cgroup_limit=None, cgroup_version="v2"),
        disk=DiskInfo(device="nvme0n1", transport="nvme", rotational=False, model="Some SSD",
                      filesystem="ext4", free=Quantity(1e11, "B"), total=Quantity(1e12, "B")))
    points = [point("sequential", "read", MiB, 32, 3e9)]
    if curve:
        points += [point("curve", "randread", s, q, bw_of(s, q)) for s in SIZES for q in QDS]
    buffered = buffered_bw if buffered_bw is not None else bw_of(MiB, 4) / 2
    points.append(point("buffered", "randread", MiB, 4, buffered, direct=False))
    gpus = [GpuInfo(index=0, name="Test GPU", vram=Quantity(24.0 * (1 << 30), "B"),
                    h2d_bandwidth=Quantity(2.5e10, "B/s"))]
    return HardwareProfile(
        schema_version=SCHEMA_VERSION,
        tool=ToolInfo(name="colibri-tune", version="0.1.0"),
        created_utc="2026-01-01T00:00:00Z",
        fingerprint=compute_fingerprint(system, gpus),
        probe=ProbeRun(mode="quick", started_utc="2026-01-01T00:00:00Z",
                       duration=Quantity(12.5, "s")),
        system=system,
        storage=StorageResult(method="fio", tool="fio-3.33", ioengine="io_uring", points=points,
                              test_file=Quantity(256.0 * MiB, "B"),
                              runtime_per_job=Quantity(0.5, "s")),
        memory_bandwidth=[MemoryBandwidthPoint(op="read", threads=1, repeats=3,
                                               buffer=Quantity(128.0 * MiB, "B"),
                                               bandwidth=Quantity(1e10, "B/s"))],
        cpu_matmul=[CpuMatmulPoint(dtype="bf16", m=1, k=2048, n=768, threads=1, calls=100,
                                throughput=Quantity(5.0, "GFLOP/s"),
                                time_per_call=Quantity(600.0, "us"))],
        gpus=gpus,
        expert_kernels=make_kernels() if kernels else [],
    )


# --- round trip -----------------------------------------------------------------------------

def test_json_round_trip_is_lossless():
    profile = make_profile()
    text = json.dumps(profile.to_dict())
    again = HardwareProfile.from_dict(json.loads(text))
    assert again == profile
    assert again.to_dict() == profile.to_dict()


def test_save_and_load(tmp_path):
    profile = make_profile()
    path = save_profile(profile, tmp_path / "profile.json")
    assert load_profile(path) == profile
    # Atomic write: nothing but the file itself is left in the directory.
    assert os.listdir(tmp_path) == ["profile.json"]


def test_save_replaces_an_existing_file_whole(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("old contents that are not a profile")
    save_profile(make_profile(), path)
    assert load_profile(path) == make_profile()


def test_save_into_missing_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot write") as err:
        save_profile(make_profile(), tmp_path / "nope" / "profile.json")
    assert "\n" not in str(err.value)


def test_load_rejects_bad_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="absent.json: no such file"):
        load_profile(tmp_path / "absent.json")


# --- strict validation ----------------------------------------------------------------------

def _mutated(fn):
    data = copy.deepcopy(make_profile().to_dict())
    fn(data)
    return data


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(extra=1), "profile: unknown key 'extra'"),
    (lambda d: d["system"]["cpu"].pop("numa_nodes"),
     "profile.system.cpu: missing key 'numa_nodes'"),
    (lambda d: d["system"]["cpu"].update(physical_cores="8"),
     "profile.system.cpu.physical_cores: expected integer"),
    (lambda d: d["system"]["cpu"].update(physical_cores=True),
     "profile.system.cpu.physical_cores: expected integer"),
    (lambda d: d["system"]["cpu"].update(physical_cores=-1),
     "profile.system.cpu.physical_cores: must not be negative"),
    (lambda d: d["storage"]["points"][1].update(direct="yes"),
     r"profile.storage.points\[1\].direct: expected boolean"),
    (lambda d: d["storage"]["points"][1]["bandwidth"].update(unit="MB/s"),
     r"profile.storage.points\[1\].bandwidth.unit: expected 'B/s', got 'MB/s'"),
    (lambda d: d["storage"]["points"][1]["bandwidth"].update(value=-5),
     r"profile.storage.points\[1\].bandwidth.value: must not be negative"),
    (lambda d: d["storage"]["points"][1]["lat_p99"].update(extra=0),
     r"profile.storage.points\[1\].lat_p99: unknown key 'extra'"),
    (lambda d: d["storage"].update(method="guess"),
     "profile.storage.method: 'guess' is not one of"),
    (lambda d: d["storage"].update(points={}), "profile.storage.points: expected an array"),
    (lambda d: d["memory_bandwidth"][0].update(op="write"), "is not one of"),
    (lambda d: d["system"]["memory"].update(total=None),
     "profile.system.memory.total: expected an object, got null"),
    (lambda d: d["gpus"][0].update(name=3), r"profile.gpus\[0\].name: expected string"),
    (lambda d: d["system"]["cpu"].update(model="Other CPU"), "does not match the hardware"),
    (lambda d: d.update(schema_version=99), "schema_version 99 is not supported"),
    (lambda d: d.update(best_configs=[{"x": float("nan")}]), "NaN"),
])
def test_from_dict_rejects_malformed_profiles(mutate, message):
    with pytest.raises(ProfileError, match=message) as err:
        HardwareProfile.from_dict(_mutated(mutate))
    assert "\n" not in str(err.value)


def test_optional_fields_accept_null_and_best_configs_accept_json_objects():
    data = _mutated(lambda d: (d["gpus"][0].update(h2d_bandwidth=None),
                               d.update(best_configs=[{"model": "qwen3", "tok_s": 1.5}])))
    profile = HardwareProfile.from_dict(data)
    assert profile.gpus[0].h2d_bandwidth is None
    assert profile.best_configs == [{"model": "qwen3", "tok_s": 1.5}]


def test_expert_kernels_are_optional_and_strictly_validated():
    # A profile probed before the kernels were timed still loads, with none.
    old = _mutated(lambda d: d.pop("expert_kernels"))
    assert HardwareProfile.from_dict(old).expert_kernels == []
    data = make_profile(kernels=True).to_dict()
    assert HardwareProfile.from_dict(json.loads(json.dumps(data))) == make_profile(kernels=True)
    for mutate, message in [
        (lambda d: d["expert_kernels"][0].update(quant="int3"), r"expert_kernels\[0\].quant: 'int3' is not one of"),
        (lambda d: d["expert_kernels"][0]["prepare_time"].update(unit="ms"), "expected 'us', got 'ms'"),
        (lambda d: d["expert_kernels"][0].pop("kernel"), "missing key 'kernel'"),
        (lambda d: d["expert_kernels"][1]["throughput"].update(value=-1.0), "must not be negative"),
    ]:
        bad = copy.deepcopy(data)
        mutate(bad)
        with pytest.raises(ProfileError, match=message):
            HardwareProfile.from_dict(bad)


def test_from_dict_rejects_non_objects():
    with pytest.raises(ProfileError, match="expected a JSON object"):
        HardwareProfile.from_dict([1, 2])


def test_load_names_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_mutated(lambda d: d.pop("gpus"))))
    with pytest.raises(ProfileError, match=f"{path}: profile: missing key 'gpus'"):
        load_profile(path)


# --- fingerprint ----------------------------------------------------------------------------

def test_fingerprint_is_hardware_only():
    profile = make_profile()
    basis = fingerprint_basis(profile.system, profile.gpus)
    assert set(basis) == {"cpu_model", "arch", "physical_cores", "logical_cores", "numa_nodes",
                          "cpu_flags", "ram_gib", "disk_transport", "disk_model",
                          "disk_rotational", "gpus"}
    # Volatile figures do not move it; hardware does.
    fp = compute_fingerprint(profile.system, profile.gpus)
    profile.system.memory.available = Quantity(1.0, "B")
    profile.system.disk.free = Quantity(1.0, "B")
    assert compute_fingerprint(profile.system, profile.gpus) == fp
    profile.system.cpu.physical_cores = 4
    assert compute_fingerprint(profile.system, profile.gpus) != fp


# --- read_bandwidth -------------------------------------------------------------------------

def test_read_bandwidth_is_exact_at_measured_points():
    profile = make_profile()
    for s in SIZES:
        for q in QDS:
            assert profile.read_bandwidth(s, q) == pytest.approx(bw_of(s, q))


def test_read_bandwidth_interpolates_in_log_size_and_log_qd():
    profile = make_profile()
    # 512 KiB is halfway between 256 KiB and 1 MiB on a log2 scale.
    mid = (bw_of(256 * KiB, 4) + bw_of(1 * MiB, 4)) / 2
    assert profile.read_bandwidth(512 * KiB, 4) == pytest.approx(mid)
    # QD 2 is halfway between QD 1 and QD 4 on a log2 scale.
    mid_qd = (bw_of(1 * MiB, 1) + bw_of(1 * MiB, 4)) / 2
    assert profile.read_bandwidth(1 * MiB, 2) == pytest.approx(mid_qd)


def test_read_bandwidth_holds_the_edges_outside_the_measured_range():
    profile = make_profile()
    assert profile.read_bandwidth(4 * KiB, 1) == pytest.approx(bw_of(64 * KiB, 1))
    assert profile.read_bandwidth(64 * MiB, 64) == pytest.approx(bw_of(16 * MiB, 16))


def test_buffered_bandwidth_scales_the_curve_by_the_measured_ratio():
    profile = make_profile(buffered_bw=bw_of(MiB, 4) * 0.5)
    assert profile.read_bandwidth(MiB, 4, direct=False) == pytest.approx(bw_of(MiB, 4) * 0.5)
    assert profile.read_bandwidth(4 * MiB, 16, direct=False) == \
        pytest.approx(bw_of(4 * MiB, 16) * 0.5)


def test_read_bandwidth_without_a_curve_is_a_profile_error():
    with pytest.raises(ProfileError, match="no direct random-read curve"):
        make_profile(curve=False).read_bandwidth(MiB, 4)


def test_read_bandwidth_rejects_nonsense_arguments():
    with pytest.raises(ValueError):
        make_profile().read_bandwidth(0, 4)


def test_docs_describe_every_field():
    """docs/PROFILE.md is the schema's documentation; a new field must be documented there."""
    import dataclasses
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "PROFILE.md").read_text()
    classes = [HardwareProfile, ToolInfo, ProbeRun, SystemInfo, CpuInfo, MemoryInfo, DiskInfo,
               StorageResult, StoragePoint, MemoryBandwidthPoint, CpuMatmulPoint, ExpertKernelPoint, GpuInfo, Quantity]
    for cls in classes:
        for f in dataclasses.fields(cls):
            spelled = (f"`{f.name}`", f".{f.name}`", f"`{f.name}.")
            assert any(s in doc for s in spelled), f"{cls.__name__}.{f.name} is not documented"


def test_shared_profile_import_checks_the_expert_kernels_too():
    from tuner.share.profile_schema import validate_shared
    data = make_profile(kernels=True).to_dict()
    profile, _, _ = validate_shared(copy.deepcopy(data))
    assert len(profile.expert_kernels) == len(make_profile(kernels=True).expert_kernels)
    data["expert_kernels"][2]["throughput"]["value"] = 1e12
    with pytest.raises(ProfileError, match=r"expert_kernels\[2\]\.throughput: .* outside the plausible range"):
        validate_shared(data)
