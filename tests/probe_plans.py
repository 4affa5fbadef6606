"""The smallest real probe: a few tiny storage jobs on a 4 MiB file, one memory and one matmul
point (seconds, not minutes). Tests that need a real profile of this machine use it."""

from __future__ import annotations

MiB = 1 << 20


def tiny_probe_plan():
    from tuner.probe import ProbePlan
    from tuner.probe.storage import StorageJob, StoragePlan
    jobs = (StorageJob("sequential", "read", 256 * 1024, 2), StorageJob("curve", "randread", 256 * 1024, 2),
            StorageJob("buffered", "randread", 256 * 1024, 2, direct=False, time_based=False))
    return ProbePlan(mode="custom", storage=StoragePlan(file_bytes=4 * MiB, runtime_s=0.05, jobs=jobs,
                                                        min_file_bytes=1 * MiB),
                     memory_buffer_bytes=4 * MiB, memory_repeats=1, matmul_ms=(1,), matmul_min_time_s=0.005,
                     measure_gpu=False, thread_counts=(1,))
