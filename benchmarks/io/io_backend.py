"""io_uring against the read pool's threads, at the expert store's read pattern.

Reads `--reads` random expert spans of the model (its own spans, O_DIRECT, page cache dropped
before each pass) into slots of a pre-faulted arena, QD requests in flight at the device,
each span whole (request = span) or cut into `--piece` sized requests as the engine does past
chunk_size, through:

    threads    engine.io.ReadPool (io_threads = QD, chunk_size = piece): one preadv per request
               into the slot, one Future per span (io_backend = "threads")
    uring      engine.io.UringPool, the same contract over one io_uring ring (PyPI `uring-api`,
               a C extension over liburing 2.15): QD reads in the kernel, one completion thread
               (io_backend = "uring")
    liburing   PyPI `liburing` (a Zig wrapper), raw: QD readv through its Iovec, submitted and
               reaped by this thread, when installed (it cannot serve the engine: see below)

and prints GB/s (median of --passes, min-max) and the CPU time the process spent per GB read
(user + sys, all threads): on a 2-core box the reader's CPU is taken from the matmuls. Within a
pass each backend reads its own experts (no span read by two backends: this virtual disk
serves blocks it read moments ago faster) and the backends' order rotates from pass to pass,
so none is always first or last. It also checks every backend's bytes against a plain pread of
the same span (one span per pass).

    python benchmarks/io/io_backend.py [--model demo] [--reads 256] [--qd 4 8] [--piece 0 1MiB]
        [--passes 3] [--uring-path DIR] [--json]

uring-api is a dependency of the engine; liburing is not: `pip install --target DIR liburing` and
pass --uring-path DIR (docs/BENCHMARKS.md, "I/O backend").
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.api import (Checkpoint, ExpertLayout, align_down, format_size, model_args, parse_size,  # noqa: E402
                        resolve_model)
from engine.api.lab import ReadPool, SlotArena, UringPool, direct_window_bytes, uring_unavailable  # noqa: E402
from benchmarks.benchkit import bench_lock, conditions, emit  # noqa: E402
from benchmarks.io.io_jobs import drop_pages  # noqa: E402


def disjoint_spans(model_dir, n: int, groups: int, seed: int) -> list[list]:
    """`groups` lists of n expert spans, no span in two lists: each backend of a pass reads its
    own experts, since this virtual disk reads blocks it served moments ago faster (host-side
    caching), which would favour whichever backend came later over the same spans."""
    ckpt = Checkpoint(model_dir)
    layout = ExpertLayout(ckpt, model_args(ckpt.config))
    keys = sorted(layout.keys())
    if n * groups > len(keys):
        raise SystemExit(f"io_backend: error: {n} reads x {groups} backends need more than the "
                         f"model's {len(keys)} experts; use --reads {len(keys) // groups}")
    picked = random.Random(seed).sample(keys, n * groups)
    return [[layout.location(*k).spans[0] for k in picked[g * n:(g + 1) * n]] for g in range(groups)]


def window(span) -> tuple[int, int]:
    """The O_DIRECT window of a span: (aligned start, aligned length)."""
    return align_down(span.offset), direct_window_bytes(span.offset, span.length)


def run_pool(spans, qd: int, piece: int, arena: SlotArena, keep: dict, pool_class=ReadPool) -> None:
    """QD spans in flight through one of the engine's read pools, each into its own slot."""
    with pool_class("direct", io_threads=qd, chunk_size=piece or (1 << 30)) as pool:
        pending = []
        for i, s in enumerate(spans):
            if len(pending) >= qd:
                pending.pop(0)[0].result()
            lease = arena.acquire()
            fut = pool.submit(s.path, s.offset, s.length, into=lease)
            if i == keep["index"]:
                keep["bytes"] = fut
            pending.append((fut, lease))
        for fut, _lease in pending:
            fut.result()
        keep["bytes"] = bytes(keep["bytes"].result())


def _pieces(spans, piece: int):
    """(span index, file offset, offset in the slot, size, bytes it must deliver) of every
    request, in span order. The aligned window may run past the end of the file, where an
    O_DIRECT read ends short: only the span's own bytes must arrive."""
    for i, s in enumerate(spans):
        lo, size = window(s)
        step = piece or size
        end = s.offset + s.length
        for at in range(0, size, step):
            n = min(step, size - at)
            yield i, lo + at, at, n, max(0, min(n, end - lo - at))


class _Landing:
    """A slot per span, from its first request to its last completion (the raw liburing backend)."""

    def __init__(self, spans, piece: int, arena: SlotArena, keep: dict):
        self.spans, self.arena, self.keep = spans, arena, keep
        self.left: dict[int, int] = {}
        for i, *_ in _pieces(spans, piece):
            self.left[i] = self.left.get(i, 0) + 1
        self.open: dict[int, list] = {}  # span index -> [lease, view]

    def view(self, i: int) -> memoryview:
        if i not in self.open:
            lease = self.arena.acquire()
            self.open[i] = [lease, memoryview(lease).cast("B")]
        return self.open[i][1]

    def landed(self, i: int) -> None:
        self.left[i] -= 1
        if self.left[i]:
            return
        _lease, view = self.open.pop(i)
        if i == self.keep["index"]:
            s = self.spans[i]
            head = s.offset - window(s)[0]
            self.keep["bytes"] = bytes(view[head:head + s.length])
        # the slot returns to the arena when the last reference (here) goes


def run_liburing(spans, qd: int, piece: int, arena: SlotArena, keep: dict, liburing) -> None:
    ring = liburing.Ring()
    liburing.io_uring_queue_init(max(qd, 2) * 2, ring)
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {s.path for s in spans}}
    cqe = liburing.Cqe()
    landing = _Landing(spans, piece, arena, keep)
    iovecs = {}  # kept alive until their read completes
    todo = _pieces(spans, piece)
    inflight, tag = 0, 0
    tags = {}
    try:
        while True:
            while inflight < qd:
                nxt = next(todo, None)
                if nxt is None:
                    break
                i, at, into, size, need = nxt
                sqe = liburing.io_uring_get_sqe(ring)
                iovecs[tag] = liburing.Iovec([landing.view(i)[into:into + size]])
                liburing.io_uring_prep_readv(sqe, fds[spans[i].path], iovecs[tag], at)
                sqe.user_data = tag
                tags[tag] = (i, need)
                tag += 1
                inflight += 1
            if not inflight:
                break
            liburing.io_uring_submit(ring)
            liburing.io_uring_wait_cqe(ring, cqe)
            entry = cqe[0]
            i, need = tags.pop(entry.user_data)
            if entry.res < need:
                raise OSError(-entry.res if entry.res < 0 else 0, f"liburing read wanted {need}, gave {entry.res}")
            iovecs.pop(entry.user_data)
            liburing.io_uring_cq_advance(ring, 1)
            inflight -= 1
            landing.landed(i)
    finally:
        for fd in fds.values():
            os.close(fd)
        liburing.io_uring_queue_exit(ring)


def reference(span) -> bytes:
    with open(span.path, "rb") as f:
        f.seek(span.offset)
        return f.read(span.length)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--reads", type=int, default=96)
    ap.add_argument("--qd", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--piece", nargs="+", default=["0", "1MiB"], help="request size; 0 = the whole span")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--uring-path", help="directory the bindings were pip-installed into with --target")
    ap.add_argument("--lock", help="flock this file around the measurement (not under `quiet bench`: see benchkit.py)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.uring_path:
        sys.path.insert(0, a.uring_path)
    backends = {"threads": run_pool}
    why = uring_unavailable()
    if why is None:
        backends["uring"] = lambda *args: run_pool(*args, pool_class=UringPool)
    else:
        print(f"io_backend: {why}: skipped", file=sys.stderr)
    try:
        import liburing
        backends["liburing"] = lambda *args: run_liburing(*args, liburing)
    except ImportError:
        print("io_backend: liburing not importable (pip install liburing): skipped", file=sys.stderr)
    model_dir = resolve_model(a.model)
    pieces = [parse_size(p) for p in a.piece]
    rows = []
    with bench_lock(a.lock):
        for qd in a.qd:
            for piece in pieces:
                results = {name: {"gbps": [], "cpu_s_per_gb": [], "bytes_ok": True} for name in backends}
                names = list(backends)
                for p in range(a.passes):
                    sets = disjoint_spans(model_dir, a.reads, len(names), seed=p * 100 + qd)
                    # The order rotates per pass, so none is always first (or last) at the disk.
                    order = names[p % len(names):] + names[:p % len(names)]
                    for name, spans in zip(order, sets):
                        run = backends[name]
                        nbytes = sum(s.length for s in spans)
                        paths = {s.path for s in spans}
                        want = reference(spans[a.reads // 2])
                        # A fresh arena each time; liburing's Iovec keeps every slot it read into
                        # referenced for good, so it gets one slot per read.
                        slots = len(spans) if name == "liburing" else 2 * qd
                        arena = SlotArena(max(window(s)[1] for s in spans), slots)
                        keep = {"index": a.reads // 2}
                        drop_pages(paths)
                        c0, t0 = os.times(), time.perf_counter()
                        try:
                            run(spans, qd, piece, arena, keep)
                        except OSError as exc:  # a backend that fails is reported, not the end of the run
                            results[name]["error"] = str(exc)
                            continue
                        secs, c1 = time.perf_counter() - t0, os.times()
                        cpu = (c1.user - c0.user) + (c1.system - c0.system)
                        results[name]["gbps"].append(nbytes / secs / 1e9)
                        results[name]["cpu_s_per_gb"].append(cpu / (nbytes / 1e9))
                        results[name]["bytes_ok"] &= keep.get("bytes") == want
                for name, r in results.items():
                    rows.append({"backend": name, "qd": qd, "request": piece or None, "reads": a.reads,
                                 "span_bytes": nbytes / a.reads, **r})
    cond = conditions(io_mode="direct", cold="page cache dropped before each read", passes=a.passes,
                      backends_skipped=[n for n in ("uring", "liburing") if n not in backends] or None)

    def gbps(r):
        g = r["gbps"]
        return f"{statistics.median(g):.2f} ({min(g):.2f}-{max(g):.2f})" if g else f"failed: {r.get('error')}"

    emit("io_backend", rows, cond, a.json, [
        ("backend", lambda r: r["backend"]), ("QD", lambda r: r["qd"]),
        ("request", lambda r: format_size(r["request"]) if r["request"] else "whole span"),
        ("GB/s median (min-max)", gbps),
        ("CPU s per GB (median)", lambda r: f"{statistics.median(r['cpu_s_per_gb']):.3f}" if r["gbps"] else None),
        ("bytes = pread", lambda r: "yes" if r["bytes_ok"] else "NO"),
        ("reads x MiB", lambda r: f"{r['reads']} x {r['span_bytes'] / 2**20:.1f}")])
    return 0

if __name__ == "__main__":
    sys.exit(main())
