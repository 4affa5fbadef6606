"""`colibri probe`: measure this machine's disk, memory and CPU into a HardwareProfile.

    profile = run_probe("/models/qwen3-30b", quick=True)
    profile.read_bandwidth(1 << 20, 8)      # bytes/s, random reads of 1 MiB at QD 8
    save_profile(profile, "profile.json")   # atomic; load_profile() validates strictly
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

from tuner import __version__
from tuner.base import interrupts
from tuner.base.text import utc_now
from tuner.probe import fallback, fio
from tuner.probe.cpu import measure_matmul
from tuner.probe.kernels import SHAPES as KERNEL_SHAPES, measure_kernels
from tuner.probe.probe_errors import ProbeError, ProfileError
from tuner.probe.memory import measure_memory_bandwidth
from tuner.probe.hardware_profile import (
    KERNEL_QUANTS, SCHEMA_VERSION, HardwareProfile, ProbeRun, Quantity, StorageResult, ToolInfo, compute_fingerprint,
    load_profile, save_profile,
)
from tuner.probe.storage import (
    MiB, StoragePlan, check_directory, check_writable, choose_file_bytes, free_bytes,
    storage_plan, scratch_file)
from tuner.probe.summary import format_summary
from tuner.probe.system import collect_system, gpu_info, thread_counts

__all__ = [
    "HardwareProfile", "ProbeError", "ProbePlan", "ProfileError", "format_summary",
    "load_profile", "probe_plan", "run_probe", "save_profile",
]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ProbePlan:
    """How much to measure. `probe_plan(quick)` gives the two standard plans; tests and
    benchmarks build smaller or larger ones."""

    mode: Literal["quick", "default", "custom"]
    storage: StoragePlan
    memory_buffer_bytes: int
    memory_repeats: int
    matmul_ms: tuple[int, ...]
    matmul_min_time_s: float
    measure_gpu: bool = True
    # Expert kernels per weight format (tuner/probe/kernels.py): rows, and seconds per timing.
    kernel_ms: tuple[int, ...] = (1, 4)
    kernel_min_time_s: float = 0.03
    kernel_shapes: tuple[tuple[int, int], ...] = KERNEL_SHAPES
    # None: 1, 2, 4, ... up to the physical cores.
    thread_counts: Optional[tuple[int, ...]] = field(default=None)


def probe_plan(quick: bool = False) -> ProbePlan:
    return ProbePlan(
        mode="quick" if quick else "default",
        storage=storage_plan(quick),
        memory_buffer_bytes=(128 if quick else 256) * MiB,
        memory_repeats=3 if quick else 5,
        matmul_ms=(1, 32) if quick else (1, 8, 32),
        matmul_min_time_s=0.05 if quick else 0.15,
        kernel_min_time_s=0.03 if quick else 0.08,
    )


def run_probe(directory: str | Path = ".", quick: bool = False, use_fio: Optional[bool] = None,
              progress: Optional[Progress] = None, *, fio_path: Optional[str] = None,
              plan: Optional[ProbePlan] = None) -> HardwareProfile:
    """Measure the machine; storage is measured on a test file in `directory`, removed after.

    use_fio: True requires fio, False uses the Python O_DIRECT fallback, None uses fio when it
    is installed. fio_path (else $COLIBRI_FIO, else PATH) picks the fio binary.
    """
    started = time.perf_counter()
    started_utc = utc_now()
    plan = plan or probe_plan(quick)
    directory = check_directory(Path(directory))
    with interrupts.kept():  # `kill` now must not leave the check file behind either
        check_writable(directory)
    file_bytes = choose_file_bytes(plan.storage, free_bytes(directory), directory)

    fio_bin = None
    if use_fio is not False:
        fio_bin = fio.find_fio(fio_path)
        named = fio_path or os.environ.get(fio.FIO_ENV)
        if fio_bin is None and (use_fio or named):
            where = f"no executable {named}" if named else "not on PATH"
            raise ProbeError(f"fio not found ({where}); install fio or use --no-fio")
    tool = fio.fio_version(fio_bin) if fio_bin else fallback.TOOL

    system = collect_system(directory)
    threads = list(plan.thread_counts or thread_counts(system.cpu.physical_cores))
    steps = _Steps(progress, total=(1 + len(plan.storage.jobs)
                                    + (4 + len(KERNEL_QUANTS)) * len(threads)
                                    + (1 if plan.measure_gpu else 0)))

    storage = _probe_storage(directory, plan.storage, file_bytes, fio_bin, tool, steps)
    memory = measure_memory_bandwidth(threads, plan.memory_buffer_bytes, plan.memory_repeats,
                                      on_step=steps.next)
    matmul = measure_matmul(threads, plan.matmul_ms, plan.matmul_min_time_s, on_step=steps.next)
    kernels = measure_kernels(threads, plan.kernel_ms, plan.kernel_min_time_s, plan.kernel_shapes,
                              on_step=steps.next)
    gpus = []
    if plan.measure_gpu:
        steps.next("GPU")
        gpus = gpu_info()

    return HardwareProfile(
        schema_version=SCHEMA_VERSION,
        tool=ToolInfo(name="colibri-tune", version=__version__),
        created_utc=utc_now(),
        fingerprint=compute_fingerprint(system, gpus),
        probe=ProbeRun(mode=plan.mode, started_utc=started_utc,
                       duration=Quantity(time.perf_counter() - started, "s")),
        system=system,
        storage=storage,
        memory_bandwidth=memory,
        cpu_matmul=matmul,
        gpus=gpus,
        expert_kernels=kernels,
    )


def _probe_storage(directory: Path, plan: StoragePlan, file_bytes: int, fio_bin: Optional[str],
                   tool: str, steps: "_Steps") -> StorageResult:
    steps.next(f"writing a {file_bytes / MiB:.0f} MiB test file in {directory}")
    # torch (needed later for memory and matmul) takes seconds to import; let it load while the
    # disk is busy writing, and finish before any measurement so it steals no CPU from one.
    preload = threading.Thread(target=_import_torch, daemon=True, name="probe-import-torch")
    preload.start()
    with interrupts.kept(), scratch_file(directory, file_bytes) as path:
        while preload.is_alive():
            preload.join(0.05)  # short waits: Ctrl-C stays responsive
        ioengine = None if fio_bin else fallback.IOENGINE
        points = []
        for job in plan.jobs:
            steps.next(f"{'fio' if fio_bin else 'fallback'} {job.label}")
            if fio_bin is None:
                points.append(fallback.run_job(job, path, file_bytes, plan.runtime_s))
            elif ioengine is None:
                point, ioengine = fio.run_first_job(fio_bin, job, path, file_bytes,
                                                    plan.runtime_s)
                points.append(point)
            else:
                points.append(fio.run_job(fio_bin, job, path, file_bytes, plan.runtime_s,
                                          ioengine))
    return StorageResult(
        method="fio" if fio_bin else "fallback", tool=tool, ioengine=ioengine, points=points,
        test_file=Quantity(float(file_bytes), "B"),
        runtime_per_job=Quantity(plan.runtime_s, "s"))


def _import_torch() -> None:
    try:
        import torch  # noqa: F401
    except Exception:  # the measurement that needs it will report the problem
        pass


class _Steps:
    def __init__(self, progress: Optional[Progress], total: int):
        self._progress = progress
        self._total = total
        self._step = 0

    def next(self, label: str) -> None:
        self._step += 1
        if self._progress is not None:
            self._progress(self._step, self._total, label)
