"""run_probe end to end on tiny plans: the fallback path, fio, error paths, clean-up on signals,
system facts, and the CLI's error line."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from colibri.cli import main
from tuner.probe import ProbePlan, format_summary, run_probe
from tuner.probe import fallback, system
from tuner.probe.probe_errors import ProbeError
from tuner.probe.hardware_profile import HardwareProfile
from tuner.probe.storage import (
    KiB, MiB, TEST_FILE_PREFIX, StorageJob, StoragePlan, choose_file_bytes, scratch_file,
    storage_plan)

from colibri_readonly import make_read_only, undo_read_only
from colibri_sync import wait_until
from colibri_requirements import needs

ROOT = Path(__file__).resolve().parent.parent
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason=needs("fio", "fio is not installed"))


def tiny_plan(min_file_bytes: int = 1 * MiB) -> ProbePlan:
    jobs = (
        StorageJob("sequential", "read", 256 * KiB, 2),
        *(StorageJob("curve", "randread", s, q) for s in (64 * KiB, 256 * KiB) for q in (1, 4)),
        StorageJob("latency_4k", "randread", 4 * KiB, 1),
        StorageJob("iops_4k", "randread", 4 * KiB, 4),
        StorageJob("buffered", "randread", 256 * KiB, 2, direct=False, time_based=False),
    )
    return ProbePlan(
        mode="custom",
        storage=StoragePlan(file_bytes=8 * MiB, runtime_s=0.05, jobs=jobs,
                            min_file_bytes=min_file_bytes),
        memory_buffer_bytes=8 * MiB, memory_repeats=2, matmul_ms=(1, 4),
        matmul_min_time_s=0.005, thread_counts=(1,), kernel_ms=(1, 2), kernel_min_time_s=0.002,
        kernel_shapes=((256, 128),))


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(TEST_FILE_PREFIX)]


class Recorder:
    def __init__(self):
        self.steps = []

    def __call__(self, step, total, label):
        self.steps.append((step, total, label))


def check_complete_profile(profile: HardwareProfile, tmp_path: Path, plan: ProbePlan) -> None:
    roles = [p.role for p in profile.storage.points]
    assert roles == [j.role for j in plan.storage.jobs]
    for pt, job in zip(profile.storage.points, plan.storage.jobs):
        assert (pt.request_bytes, pt.queue_depth, pt.direct) == \
            (job.request_bytes, job.queue_depth, job.direct)
        assert pt.bandwidth.value > 0
        assert pt.bandwidth.value == pytest.approx(pt.iops.value * pt.request_bytes, rel=0.01)
        assert 0 < pt.lat_p50.value <= pt.lat_p99.value
    assert {(m.op, m.threads) for m in profile.memory_bandwidth} == {("read", 1), ("copy", 1)}
    assert {(m.dtype, m.m) for m in profile.cpu_matmul} == \
        {("bf16", 1), ("bf16", 4), ("fp32", 1), ("fp32", 4)}
    assert all(m.throughput.value > 0 for m in profile.cpu_matmul)
    # Expert kernels: every weight format at every shape and row count, through the kernel the
    # engine picks for it (engine/weights/quantized.py) — never silently the bf16 one for a quantized format.
    assert {(k.quant, k.m, k.k, k.n) for k in profile.expert_kernels} == \
        {(q, m, 256, 128) for q in ("bf16", "int8", "int4") for m in (1, 2)}
    kernels = {k.quant: k.kernel for k in profile.expert_kernels}
    # bf16 as the engine calls it: one row on the native kernel where it loads, else F.linear.
    assert {k.kernel for k in profile.expert_kernels if k.quant == "bf16"} <= {"F.linear", "engine.native.linear"}
    assert {k.kernel for k in profile.expert_kernels if k.quant == "bf16" and k.m > 1} == {"F.linear"}
    assert kernels["int8"] in ("aten._weight_int8pack_mm", "dequantize+linear")
    # int4: engine/native's strips where its int kernels load (VNNI/VBMI), else torch's
    assert kernels["int4"] in ("colibri int4 strips (VNNI)", "aten._weight_int4pack_mm_for_cpu", "dequantize+linear")
    assert all(k.throughput.value > 0 and k.calls >= 1 for k in profile.expert_kernels)
    assert all((k.group_size == 64) == (k.quant == "int4") for k in profile.expert_kernels)
    assert "Expert kernels" in format_summary(profile)
    # The profile survives its own strict validation and says nothing personal.
    text = json.dumps(profile.to_dict())
    assert HardwareProfile.from_dict(json.loads(text)) == profile
    assert str(tmp_path) not in text
    host = socket.gethostname()
    assert len(host) < 4 or host not in text
    assert profile.read_bandwidth(128 * KiB, 2) > 0
    assert profile.read_bandwidth(128 * KiB, 2, direct=False) > 0
    assert leftovers(tmp_path) == []


# --- the two storage paths ------------------------------------------------------------------

def test_fallback_probe_end_to_end(tmp_path):
    progress = Recorder()
    plan = tiny_plan()
    profile = run_probe(tmp_path, use_fio=False, plan=plan, progress=progress)
    assert profile.storage.method == "fallback"
    assert profile.storage.tool == fallback.TOOL and profile.storage.ioengine == "python-threads"
    check_complete_profile(profile, tmp_path, plan)
    assert "FALLBACK (no fio)" in format_summary(profile)
    total = progress.steps[0][1]
    assert [s[0] for s in progress.steps] == list(range(1, total + 1))
    assert any(label.startswith("fallback randread 64KiB QD4") for _, _, label in progress.steps)


@needs_fio
def test_fio_probe_end_to_end(tmp_path):
    plan = tiny_plan()
    profile = run_probe(tmp_path, use_fio=True, plan=plan)
    assert profile.storage.method == "fio" and profile.storage.tool.startswith("fio-")
    assert profile.storage.ioengine in ("io_uring", "libaio", "psync")
    check_complete_profile(profile, tmp_path, plan)
    assert "Storage  fio: fio-" in format_summary(profile)


def test_without_fio_on_path_the_fallback_is_used(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("COLIBRI_FIO", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    profile = run_probe(work, plan=tiny_plan())
    assert profile.storage.method == "fallback"


def test_fallback_reads_each_block_at_most_once_when_asked(tmp_path):
    job = StorageJob("buffered", "randread", 64 * KiB, 4, direct=False, time_based=False)
    with scratch_file(tmp_path, 4 * MiB) as path:
        point = fallback.run_job(job, path, 4 * MiB, runtime_s=30.0)
    ios = round(point.iops.value * point.runtime.value)
    assert ios == 64  # the whole file once, then the job ends well before its 30 s cap


def test_offsets_cover_every_block_once_per_pass():
    once = fallback._Offsets(50, sequential=False, once=True, seed=1)
    seen = [once.next() for _ in range(50)]
    assert sorted(seen) == list(range(50)) and seen != list(range(50))
    assert once.next() is None
    looping = fallback._Offsets(3, sequential=True, once=False, seed=1)
    assert [looping.next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


# --- error paths ----------------------------------------------------------------------------

def test_fio_missing_when_required(tmp_path):
    with pytest.raises(ProbeError, match="fio not found .*use --no-fio"):
        run_probe(tmp_path, use_fio=True, fio_path=str(tmp_path / "nofio"), plan=tiny_plan())
    assert leftovers(tmp_path) == []


def _fake_fio(tmp_path: Path, version_ok: bool) -> Path:
    script = tmp_path / "fake-fio"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then {"echo fio-3.33; exit 0" if version_ok else ":"}; fi\n'
        'echo "fio: pretend failure: disk on fire" >&2\n'
        "exit 1\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("version_ok, message", [
    (True, "fio failed on .*: fio: pretend failure: disk on fire"),  # fails running a job
    (False, "fio failed: fio: pretend failure"),  # fails at the version check
])
def test_fio_failing_reports_fios_own_message_and_cleans_up(tmp_path, version_ok, message):
    work = tmp_path / "work"
    work.mkdir()
    fake = _fake_fio(tmp_path, version_ok=version_ok)
    with pytest.raises(ProbeError, match=message):
        run_probe(work, fio_path=str(fake), plan=tiny_plan())
    assert leftovers(work) == []


def test_missing_directory_and_plain_file(tmp_path):
    with pytest.raises(ProbeError, match="no such directory"):
        run_probe(tmp_path / "absent", use_fio=False, plan=tiny_plan())
    (tmp_path / "f").write_text("x")
    with pytest.raises(ProbeError, match="not a directory"):
        run_probe(tmp_path / "f", use_fio=False, plan=tiny_plan())


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs sysfs")
def test_unwritable_directory_sysfs():
    # sysfs refuses new files even to root, so this holds whoever runs the tests.
    with pytest.raises(ProbeError, match="cannot write a test file in /sys: Permission denied"):
        run_probe("/sys", use_fio=False, plan=tiny_plan())


def test_unwritable_directory_permissions(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    why_not = make_read_only(locked)  # mode 555, or as root the immutable flag (root ignores modes)
    if why_not:
        pytest.skip(why_not)
    try:
        with pytest.raises(ProbeError, match="cannot write a test file"):
            run_probe(locked, use_fio=False, plan=tiny_plan())
    finally:
        undo_read_only(locked)


def test_too_little_free_space(tmp_path):
    plan = storage_plan(quick=True)
    with pytest.raises(ProbeError, match="too little free space in /x: 100 MiB free"):
        choose_file_bytes(plan, 100 * MiB, Path("/x"))
    # Enough space: the plan's size, capped at half of what is free, whole largest requests.
    assert choose_file_bytes(plan, 100 << 30, Path("/x")) == plan.file_bytes
    assert choose_file_bytes(plan, 300 * MiB, Path("/x")) == 144 * MiB
    # Through run_probe, with a minimum this disk cannot meet: error, and nothing written.
    with pytest.raises(ProbeError, match="too little free space"):
        run_probe(tmp_path, use_fio=False, plan=tiny_plan(min_file_bytes=1 << 60))
    assert leftovers(tmp_path) == []


def test_cli_prints_one_error_line(tmp_path, capsys):
    assert main(["probe", "--dir", str(tmp_path / "absent"), "--no-fio"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"colibri probe: error: {tmp_path / 'absent'}: no such directory"


# --- clean-up on signals --------------------------------------------------------------------

def _start_cli(tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "colibri.cli", "probe", "--dir", str(tmp_path), "--quick", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _scratch_files(directory: Path) -> list[str]:
    """The storage test file (not the writability check's, which exists before the probe turns
    SIGTERM into a clean stop, and only for a moment)."""
    return [n for n in leftovers(directory) if n.endswith(".tmp")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_writing_the_test_file_removes_it(tmp_path, sig):
    proc = _start_cli(tmp_path, "--no-fio")
    try:
        wait_until(lambda: _scratch_files(tmp_path), "the storage test file", proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "colibri probe: interrupted" in err
    assert leftovers(tmp_path) == []


@needs_fio
@pytest.mark.slow
def test_sigterm_during_a_fio_job_kills_fio_and_removes_the_file(tmp_path):
    proc = _start_cli(tmp_path)
    try:
        parent = psutil.Process(proc.pid)

        def fio_children():
            # `fio --version` runs before the test file exists; wait for a job on the file.
            if not _scratch_files(tmp_path):
                return []
            return [c for c in parent.children() if c.name() == "fio"]
        children = wait_until(fio_children, "a fio job on the test file", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert leftovers(tmp_path) == []
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


# --- system facts ---------------------------------------------------------------------------

def test_cpuinfo_parsing_keeps_the_flags_that_matter(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Fancy CPU 9000\n"
                       "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile amx_bf16\n\n"
                       "processor\t: 1\nmodel name\t: Fancy CPU 9000\nflags\t\t: fpu\n")
    info = system.cpu_info(str(cpuinfo))
    assert info.model == "Fancy CPU 9000"
    assert info.flags == ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_bf16"]
    assert info.physical_cores >= 1 and info.logical_cores >= info.physical_cores


def test_thread_counts():
    assert system.thread_counts(1) == [1]
    assert system.thread_counts(2) == [1, 2]
    assert system.thread_counts(6) == [1, 2, 4, 6]
    assert system.thread_counts(8) == [1, 2, 4, 8]


def test_cgroup_version(tmp_path):
    v1 = tmp_path / "v1"
    v1.write_text("5:devices:/\n4:memory:/user.slice\n0::/\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/user.slice/session.scope\n")
    assert system.cgroup_version(str(v1)) == "v1"
    assert system.cgroup_version(str(v2)) == "v2"
    assert system.cgroup_version(str(tmp_path / "absent")) is None


def test_disk_info_of_a_real_directory(tmp_path):
    disk = system.disk_info(tmp_path)
    assert disk.free.value > 0 and disk.total.value >= disk.free.value
    assert isinstance(disk.transport, str) and disk.transport
    assert disk.filesystem
