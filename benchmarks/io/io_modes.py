"""Cold read throughput of the read pool: every io_mode x chunk_size x io_threads.

Reads a file (512 MiB by default, created with random bytes if absent) in expert-sized
requests at shuffled offsets, keeping a few requests in flight as the runtime's prefetch does.
Before every measured pass the file's pages are dropped with posix_fadvise(DONTNEED) and a
fresh pool is opened, so buffered and mmap start cold too. Prints the median GB/s over repeats
with its min-max spread.

    .venv/bin/python benchmarks/io/io_modes.py [--file PATH] [--size-mib 512] [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tqdm import tqdm  # noqa: E402

from engine.api.lab import IOStats, IO_MODES, ReadPool  # noqa: E402
from benchmarks.benchkit import conditions, emit  # noqa: E402

MiB = 1 << 20


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        left = size
        while left:
            n = min(left, 16 * MiB)
            fh.write(os.urandom(n))
            left -= n
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def one_pass(path: str, mode: str, chunk: int, threads: int, request: int, inflight: int, seed: int) -> dict:
    size = os.path.getsize(path)
    offsets = list(range(0, size, request))
    random.Random(seed).shuffle(offsets)
    stats = IOStats()
    with ReadPool(mode, io_threads=threads, chunk_size=chunk, stats=stats) as pool:
        pool.drop_page_cache(path)
        pending: deque = deque()
        t0 = time.perf_counter()
        for off in offsets:
            pending.append(pool.submit(path, off, min(request, size - off)))
            if len(pending) >= inflight:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        wall = time.perf_counter() - t0
        effective = pool.effective_mode
    snap = stats.snapshot()
    return {"wall_s": wall, "gbps": snap["bytes_requested"] / wall / 1e9, "effective_mode": effective, **snap}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, help="file to read (default: a temp file, removed after)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--modes", default=",".join(IO_MODES))
    ap.add_argument("--chunks-kib", default="64,1024,4096", help="chunk sizes in KiB")
    ap.add_argument("--threads", default="1,4")
    ap.add_argument("--request-mib", type=float, default=8.0, help="bytes per submit (an expert)")
    ap.add_argument("--inflight", type=int, default=2, help="submits kept in flight (prefetch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args(argv)

    made_tmp = args.file is None
    path = args.file or Path(tempfile.gettempdir()) / "colibri-io-bench.bin"
    size = args.size_mib * MiB
    if made_tmp or not args.file.exists():
        print(f"writing {args.size_mib} MiB of random data to {path} ...", file=sys.stderr)
        make_file(path, size)
    request = int(args.request_mib * MiB)
    modes = args.modes.split(",")
    chunks = [int(c) * 1024 for c in args.chunks_kib.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    configs = [(m, c, t) for m in modes for c in chunks for t in threads]

    rows = []
    try:
        bar = tqdm(total=len(configs) * args.repeats, desc="io bench", file=sys.stderr, unit="pass")
        for rep in range(args.repeats):
            # Interleave configs across repeats so drift in the (virtual, noisy) disk spreads evenly.
            for mode, chunk, nthreads in configs:
                r = one_pass(str(path), mode, chunk, nthreads, request, args.inflight, seed=rep)
                rows.append({"mode": mode, "chunk": chunk, "threads": nthreads, "repeat": rep, **r})
                bar.update()
        bar.close()
    finally:
        if made_tmp:
            path.unlink(missing_ok=True)

    summary = []
    for mode, chunk, nthreads in configs:
        runs = [r for r in rows if (r["mode"], r["chunk"], r["threads"]) == (mode, chunk, nthreads)]
        gbps = [r["gbps"] for r in runs]
        summary.append(
            {
                "mode": mode,
                "effective_mode": runs[0]["effective_mode"],
                "chunk_kib": chunk // 1024,
                "io_threads": nthreads,
                "median_gbps": statistics.median(gbps),
                "min_gbps": min(gbps),
                "max_gbps": max(gbps),
                "bytes_read_per_pass": runs[0]["bytes_read"],
                "chunk_requests_per_pass": runs[0]["requests"],
            }
        )
    cond = conditions(file_mib=size // MiB, request_mib=args.request_mib, inflight=args.inflight,
                      repeats=args.repeats, cold="posix_fadvise(DONTNEED) before every pass")
    emit("io_modes", summary, cond, args.json, [
        ("mode", lambda s: s["mode"] if s["mode"] == s["effective_mode"] else f"{s['mode']}->{s['effective_mode']}"),
        ("chunk", lambda s: f"{s['chunk_kib']} KiB"), ("threads", lambda s: s["io_threads"]),
        ("GB/s (median)", lambda s: f"{s['median_gbps']:.2f}"),
        ("min-max", lambda s: f"{s['min_gbps']:.2f}-{s['max_gbps']:.2f}")])
    return 0

if __name__ == "__main__":
    sys.exit(main())
