"""The storage probe's plan and its test file; fio.py and fallback.py run the jobs.

One plan feeds both runners, so the fio curve and the Python fallback curve are measured at the
same points and can be compared one to one (benchmarks/io/probe_fallback_agreement.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from engine.api import size_label
from tuner.probe.probe_errors import ProbeError
from tuner.probe.hardware_profile import Quantity, StoragePoint, StorageRole

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Expert-sized requests: a 4-bit expert of a 30B MoE is ~1-3 MiB, of GLM-5 ~19 MiB.
CURVE_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
CURVE_QDS = (1, 4, 16)
QUICK_CURVE_QDS = (1, 16)
# The point the buffered-vs-direct comparison is made at: the engine's default request size and
# a modest read pool.
MAIN_POINT = (1 * MiB, 4)

DEFAULT_FILE_BYTES = 512 * MiB
QUICK_FILE_BYTES = 256 * MiB
MIN_FILE_BYTES = 64 * MiB
TEST_FILE_PREFIX = ".colibri-probe-"


@dataclass(frozen=True)
class StorageJob:
    role: StorageRole
    pattern: str  # "read" (sequential) or "randread"
    request_bytes: int
    queue_depth: int
    direct: bool = True
    # False: read every block at most once (buffered job), so the page cache cannot serve a
    # block twice and flatter the figure; the runtime is then only a cap.
    time_based: bool = True

    @property
    def label(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return f"{self.pattern} {size_label(self.request_bytes)} QD{self.queue_depth} {mode}"


@dataclass(frozen=True)
class StoragePlan:
    file_bytes: int
    runtime_s: float
    jobs: tuple[StorageJob, ...]
    min_file_bytes: int = MIN_FILE_BYTES

    def __post_init__(self):
        if not self.jobs:
            raise ValueError("a storage plan needs at least one job")
        if self.runtime_s <= 0:
            raise ValueError("runtime_s must be positive")


def storage_plan(quick: bool = False) -> StoragePlan:
    qds = QUICK_CURVE_QDS if quick else CURVE_QDS
    jobs = [StorageJob("sequential", "read", 1 * MiB, 32)]
    jobs += [StorageJob("curve", "randread", size, qd) for size in CURVE_SIZES for qd in qds]
    jobs += [
        StorageJob("latency_4k", "randread", 4 * KiB, 1),
        StorageJob("iops_4k", "randread", 4 * KiB, 32),
        StorageJob("buffered", "randread", MAIN_POINT[0], MAIN_POINT[1], direct=False,
                   time_based=False),
    ]
    return StoragePlan(
        file_bytes=QUICK_FILE_BYTES if quick else DEFAULT_FILE_BYTES,
        runtime_s=0.4 if quick else 1.25,
        jobs=tuple(jobs),
    )


def choose_file_bytes(plan: StoragePlan, free_bytes: int, directory: Path) -> int:
    """The test file size: the plan's, but never more than half of the free space, rounded to
    the largest request so every request fits; too little space is an error, not a tiny file
    that the disk's own cache would serve."""
    largest = max([j.request_bytes for j in plan.jobs] + [4 * KiB])
    size = min(plan.file_bytes, free_bytes // 2)
    size -= size % largest
    if size < plan.min_file_bytes:
        raise ProbeError(
            f"too little free space in {directory}: {free_bytes / MiB:.0f} MiB free, the storage "
            f"probe needs {2 * plan.min_file_bytes / MiB:.0f} MiB (a test file of at least "
            f"{plan.min_file_bytes / MiB:.0f} MiB, at most half of the free space)")
    return size


def check_directory(directory: Path) -> Path:
    directory = Path(directory)
    if not directory.exists():
        raise ProbeError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise ProbeError(f"{directory}: not a directory")
    return directory.resolve()


def check_writable(directory: Path) -> None:
    """Fail early, before minutes of work, if no test file can be created here."""
    with _new_test_file(directory, ".check") as (_, fd):
        os.close(fd)


@contextlib.contextmanager
def _new_test_file(directory: Path, suffix: str) -> Iterator[tuple[Path, int]]:
    """A new file (O_EXCL) in `directory` and its fd (the caller closes it), removed on exit
    whatever happens. The removal hangs on the name, not on the fd: Ctrl-C (or SIGTERM under
    `interrupts.kept`) may land right after the open returned, before the fd is bound."""
    path = directory / f"{TEST_FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    ours = True
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            ours = exc.errno != errno.EEXIST  # someone else's file: never remove it
            raise ProbeError(f"cannot write a test file in {directory}: {exc.strerror}") from None
        yield path, fd
    finally:
        if ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@contextlib.contextmanager
def scratch_file(directory: Path, size: int) -> Iterator[Path]:
    """A file of `size` pseudo-random bytes in `directory`, dropped from the page cache, removed
    on exit whatever happens (exception, Ctrl-C, or SIGTERM inside `interrupts.kept`).
    """
    with _new_test_file(directory, ".tmp") as (path, fd):
        try:
            _fill(fd, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ProbeError(f"ran out of space writing a {size / MiB:.0f} MiB test file "
                                 f"in {directory}") from None
            raise ProbeError(f"cannot write a test file in {directory}: {exc.strerror}") from None
        finally:
            os.close(fd)
        yield path


def _fill(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Not every filesystem can preallocate; the writes below allocate anyway.
    block = 8 * MiB
    # Random, and different in every block, so no layer below can dedupe or compress it away.
    buf = np.frombuffer(os.urandom(block), dtype=np.uint64).copy()
    written = 0
    while written < size:
        buf[::512] = written // 4096  # stamp the first word of every 4 KiB page
        view = memoryview(buf).cast("B")[: min(block, size - written)]
        while len(view):
            n = os.write(fd, view)
            view = view[n:]
            written += n
    os.fsync(fd)
    # The probe measures the disk, not the writes it just made.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def make_point(job: StorageJob, *, runtime_s: float, bandwidth_bps: float, iops: float,
               lat_mean_us: float, lat_p50_us: float, lat_p99_us: float) -> StoragePoint:
    if runtime_s <= 0 or bandwidth_bps <= 0:
        raise ProbeError(f"storage job {job.label} read nothing")
    return StoragePoint(
        role=job.role, pattern=job.pattern, request_bytes=job.request_bytes,
        queue_depth=job.queue_depth, direct=job.direct,
        runtime=Quantity(runtime_s, "s"),
        bandwidth=Quantity(bandwidth_bps, "B/s"),
        iops=Quantity(iops, "IO/s"),
        lat_mean=Quantity(lat_mean_us, "us"),
        lat_p50=Quantity(lat_p50_us, "us"),
        lat_p99=Quantity(lat_p99_us, "us"),
    )
