"""Memory bandwidth per thread count: a large array summed (read) and copied (read + write).

torch runs both with its intra-op thread pool, the same pool the engine's matmuls use, so the
thread counts mean the same thing here as in `--threads`.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from tuner.probe.hardware_profile import MemoryBandwidthPoint, Quantity


def measure_memory_bandwidth(thread_counts: Sequence[int], buffer_bytes: int, repeats: int,
                             on_step: Callable[[str], None] | None = None
                             ) -> list[MemoryBandwidthPoint]:
    import torch

    n = buffer_bytes // 4
    src = torch.ones(n, dtype=torch.float32)  # ones, not empty: every page is really mapped
    dst = torch.zeros_like(src)
    previous = torch.get_num_threads()
    points = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for op in ("read", "copy"):
                if on_step:
                    on_step(f"memory {op} {threads} thread{'s' if threads > 1 else ''}")
                run = (lambda: src.sum()) if op == "read" else (lambda: dst.copy_(src))
                run()  # warm-up: thread pool started, caches in their steady state
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                moved = buffer_bytes * (1 if op == "read" else 2)
                points.append(MemoryBandwidthPoint(
                    op=op, threads=threads, repeats=repeats,
                    buffer=Quantity(float(buffer_bytes), "B"),
                    bandwidth=Quantity(moved / statistics.median(times), "B/s")))
    finally:
        torch.set_num_threads(previous)
    return points
