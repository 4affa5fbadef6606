"""Matmul throughput shaped like MoE experts: `F.linear(x[m,k], W[n,k])`, as the engine calls
it, for m = 1 (a decode-time GEMV) and small m (a few tokens routed to one expert in prefill).

k = 2048, n = 768 is one projection of a Qwen3-30B-A3B expert (hidden 2048, intermediate 768).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, get_args

from tuner.probe.hardware_profile import CpuMatmulPoint, MatmulDtype, Quantity

EXPERT_K, EXPERT_N = 2048, 768
DTYPES = get_args(MatmulDtype)


def measure_matmul(thread_counts: Sequence[int], ms: Sequence[int], min_time_s: float,
                   k: int = EXPERT_K, n: int = EXPERT_N,
                   on_step: Callable[[str], None] | None = None) -> list[CpuMatmulPoint]:
    import torch
    import torch.nn.functional as F

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}
    gen = torch.Generator().manual_seed(0)
    points = []
    for threads, dtype in each_thread_count(thread_counts, DTYPES, "matmul", on_step):
        w = torch.randn(n, k, generator=gen).to(torch_dtype[dtype])
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch_dtype[dtype])
            calls, elapsed = time_calls(lambda: F.linear(x, w), min_time_s)
            per_call = elapsed / calls
            points.append(CpuMatmulPoint(
                dtype=dtype, m=m, k=k, n=n, threads=threads, calls=calls,
                throughput=Quantity(2.0 * m * k * n / per_call / 1e9, "GFLOP/s"),
                time_per_call=Quantity(per_call * 1e6, "us")))
    return points


def each_thread_count(thread_counts: Sequence[int], kinds: Sequence[str], what: str,
                      on_step: Callable[[str], None] | None):
    """(threads, kind) for every thread count and kind, with torch's intra-op pool set to that
    count (restored afterwards, also on an exception) and one progress step per pair."""
    import torch
    previous = torch.get_num_threads()
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for kind in kinds:
                if on_step:
                    on_step(f"{what} {kind} {threads} thread{'s' if threads > 1 else ''}")
                yield threads, kind
    finally:
        torch.set_num_threads(previous)


def time_calls(fn: Callable[[], object], min_time_s: float) -> tuple[int, float]:
    """Calls and seconds for one batch lasting about min_time_s, sized from a timed warm-up."""
    fn()  # first call: kernel selection, thread pool start
    t0 = time.perf_counter()
    fn()
    estimate = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(1_000_000, round(min_time_s / estimate)))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls, time.perf_counter() - t0
