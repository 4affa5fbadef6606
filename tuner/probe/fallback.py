"""Storage jobs without fio: O_DIRECT `preadv` from Python threads, one thread per queue slot.

`os.preadv` releases the GIL, so N threads keep up to N requests in flight, as fio's iodepth
does. Python's per-request overhead (a few µs) makes small requests at high depth read lower
than fio; the profile labels these figures as the fallback's.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from tuner.probe.probe_errors import ProbeError
from tuner.probe.hardware_profile import StoragePoint
from tuner.probe.storage import StorageJob, make_point

TOOL = "python O_DIRECT threads"
IOENGINE = "python-threads"


class _Offsets:
    """Block indices in fio's order: sequential, or a random permutation (no block read twice
    before all were read once); `once` stops after one pass instead of starting another."""

    def __init__(self, n_blocks: int, sequential: bool, once: bool, seed: int):
        self._n = n_blocks
        self._sequential = sequential
        self._once = once
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._order = self._new_pass()
        self._pos = 0
        self._passes = 1

    def _new_pass(self) -> np.ndarray:
        return np.arange(self._n) if self._sequential else self._rng.permutation(self._n)

    def next(self) -> int | None:
        with self._lock:
            if self._pos == self._n:
                if self._once:
                    return None
                self._order = self._new_pass()
                self._pos = 0
            index = int(self._order[self._pos])
            self._pos += 1
            return index


def run_job(job: StorageJob, path: Path, file_bytes: int, runtime_s: float,
            seed: int = 0) -> StoragePoint:
    flags = os.O_RDONLY | (os.O_DIRECT if job.direct else 0)
    if job.direct and not hasattr(os, "O_DIRECT"):
        raise ProbeError("the fallback storage probe needs O_DIRECT (Linux)")
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        hint = " (the filesystem may not support direct I/O)" if job.direct else ""
        raise ProbeError(f"cannot open the test file {path}: {exc.strerror}{hint}") from None
    try:
        if not job.direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return _measure(fd, job, file_bytes, runtime_s, seed)
    finally:
        os.close(fd)


def _measure(fd: int, job: StorageJob, file_bytes: int, runtime_s: float,
             seed: int) -> StoragePoint:
    size = job.request_bytes
    offsets = _Offsets(file_bytes // size, job.pattern == "read", not job.time_based, seed)
    stop = threading.Event()
    latencies: list[list[int]] = [[] for _ in range(job.queue_depth)]
    errors: list[OSError] = []

    def worker(slot: int) -> None:
        # An anonymous mapping is page-aligned, as O_DIRECT requires of the buffer.
        buf = mmap.mmap(-1, size)
        lat = latencies[slot]
        try:
            while not stop.is_set():
                index = offsets.next()
                if index is None:
                    return
                t0 = time.perf_counter_ns()
                n = os.preadv(fd, [buf], index * size)
                lat.append(time.perf_counter_ns() - t0)
                if n != size:
                    raise OSError(0, f"short read: {n} of {size} bytes")
        except OSError as exc:
            errors.append(exc)
            stop.set()
        finally:
            buf.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True, name=f"probe-read-{i}")
               for i in range(job.queue_depth)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    try:
        deadline = start + runtime_s
        # Short waits keep the main thread responsive to Ctrl-C and SIGTERM.
        while time.perf_counter() < deadline and any(t.is_alive() for t in threads):
            stop.wait(min(0.05, max(0.0, deadline - time.perf_counter())))
    finally:
        stop.set()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - start
    if errors:
        exc = errors[0]
        raise ProbeError(f"fallback read failed on {job.label}: {exc.strerror or exc}")
    samples = np.concatenate([np.asarray(x, dtype=np.int64) for x in latencies])
    if samples.size == 0:
        raise ProbeError(f"fallback job {job.label} completed no read in {runtime_s} s")
    us = samples / 1000.0
    return make_point(
        job, runtime_s=elapsed,
        bandwidth_bps=samples.size * size / elapsed,
        iops=samples.size / elapsed,
        lat_mean_us=float(us.mean()),
        lat_p50_us=float(np.percentile(us, 50)),
        lat_p99_us=float(np.percentile(us, 99)),
    )
