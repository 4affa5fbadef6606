"""io_uring against the read pool's threads, at the expert store's read pattern.

Reads `--reads` random expert-sized spans (the model's own expert spans, O_DIRECT, page cache
dropped first) into a pre-faulted arena, `--qd` in flight, through:

    threads    engine.io.ReadPool (io_threads = qd), one preadv per span into a slot
    io_uring   the `liburing` binding from PyPI, one ring, qd reads submitted and reaped

and prints GB/s (median of --passes, min-max). The engine keeps the thread pool unless io_uring
measures faster here (docs/BENCHMARKS.md, "I/O backend"). io_uring needs `pip install liburing`
(or --uring-path DIR where it was installed with --target).

    python benchmarks/io_backend.py [--model demo] [--reads 96] [--qd 4 8] [--passes 3]
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.checkpoint import Checkpoint  # noqa: E402
from engine.io import ReadPool, align_up, direct_window_bytes  # noqa: E402
from engine.layout import ExpertLayout  # noqa: E402
from engine.model import ModelArgs  # noqa: E402
from engine.models import resolve_model  # noqa: E402
from engine.slots import SlotArena  # noqa: E402


def spans_of(model_dir, n: int, seed: int):
    ckpt = Checkpoint(model_dir)
    layout = ExpertLayout(ckpt, ModelArgs.from_config(ckpt.config))
    keys = sorted(layout.keys())
    rng = random.Random(seed)
    return [layout.location(*k).spans[0] for k in rng.sample(keys, n)]


def drop(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def run_threads(spans, qd: int, arena: SlotArena) -> float:
    with ReadPool("direct", io_threads=qd, chunk_size=64 << 20) as pool:
        t0 = time.perf_counter()
        pending = []
        for s in spans:
            if len(pending) >= qd:
                pending.pop(0)[0].result()
            lease = arena.acquire()
            pending.append((pool.submit(s.path, s.offset, s.length, into=lease), lease))
        for fut, _lease in pending:
            fut.result()
        return time.perf_counter() - t0


def run_uring(spans, qd: int, arena: SlotArena, liburing) -> float:
    ring = liburing.Ring()
    liburing.io_uring_queue_init(max(qd, 2) * 2, ring)
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {s.path for s in spans}}
    cqe = liburing.Cqe()
    leases = [arena.acquire() for _ in range(qd)]
    views = [memoryview(lease) for lease in leases]
    try:
        t0 = time.perf_counter()
        it = iter(enumerate(spans))
        inflight = 0
        free = list(range(qd))
        iovecs = [None] * qd  # kept alive until the read completes

        def submit_more():
            nonlocal inflight
            while free:
                nxt = next(it, None)
                if nxt is None:
                    break
                _i, s = nxt
                slot = free.pop()
                lo = s.offset - s.offset % 4096
                size = direct_window_bytes(s.offset, s.length)
                sqe = liburing.io_uring_get_sqe(ring)
                # The binding takes bytearray or memoryview only through Iovec (readv).
                iovecs[slot] = liburing.Iovec([views[slot][:align_up(size)]])
                liburing.io_uring_prep_readv(sqe, fds[s.path], iovecs[slot], lo)
                sqe.user_data = slot
                inflight += 1
            liburing.io_uring_submit(ring)

        submit_more()
        while inflight:
            liburing.io_uring_wait_cqe(ring, cqe)
            entry = cqe[0]
            if entry.res < 0:
                raise OSError(-entry.res, os.strerror(-entry.res))
            free.append(entry.user_data)
            liburing.io_uring_cq_advance(ring, 1)
            inflight -= 1
            submit_more()
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        liburing.io_uring_queue_exit(ring)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--reads", type=int, default=96)
    ap.add_argument("--qd", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--uring-path", help="directory liburing was pip-installed into with --target")
    ap.add_argument("--lock", default="/tmp/colibri-bench.lock")
    a = ap.parse_args()
    if a.uring_path:
        sys.path.insert(0, a.uring_path)
    try:
        import liburing
    except ImportError:
        print("io_backend: error: the liburing binding is not installed (pip install liburing)", file=sys.stderr)
        return 2
    model_dir = resolve_model(a.model)
    print("| backend | QD | GB/s median (min-max) | reads x MiB |")
    print("|---|---|---|---|")
    with open(a.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for qd in a.qd:
            results = {"threads": [], "io_uring": []}
            for p in range(a.passes):
                spans = spans_of(model_dir, a.reads, seed=p * 100 + qd)
                nbytes = sum(s.length for s in spans)
                paths = {s.path for s in spans}
                # Interleaved, so a drift of the disk hits both backends alike.
                for name in ("threads", "io_uring"):
                    # A fresh arena each time: the binding's Iovec keeps its buffers referenced
                    # after the ring is gone, so its slots never come back.
                    arena = SlotArena(max(direct_window_bytes(s.offset, s.length) for s in spans), qd)
                    drop(paths)
                    secs = run_threads(spans, qd, arena) if name == "threads" else run_uring(spans, qd, arena, liburing)
                    results[name].append(nbytes / secs / 1e9)
            for name, vals in results.items():
                print(f"| {name} | {qd} | {statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}) | "
                      f"{a.reads} x {nbytes / a.reads / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
