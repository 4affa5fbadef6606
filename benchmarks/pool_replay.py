"""Replay a read trace through the engine's own reader, paced as trace_bound.py's fio replay.

A cross-check of the fio replay. Same trace, same pieces (the pool splits them itself), same
device QD (io_threads readers), same pacing (an idle gap before each token's reads, counted
from the last submit, as fio counts a job's delay from its last issue) — but the engine's
syscalls (preadv from Python threads), its one FIFO queue and its page-aligned, pre-faulted,
THP-advised slot buffers (engine/movement/slots.py) instead of fio's processes and malloc'd buffers.
If this replay reads faster than fio's replay of the same trace, the difference is the I/O
path, not the load shape. In-process and O_DIRECT or buffered as the trace; a direct read
does not touch the page cache, so the budget's cgroup does not change it.

    python benchmarks/pool_replay.py TRACE [--gap-s 0.024] [--passes 4] [--repeats 2] [--with-fio]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.movement.io import ReadPool  # noqa: E402
from engine.movement.io.trace import read_trace  # noqa: E402
from engine.movement.slots import SlotArena  # noqa: E402
from benchmarks.fio_bound import drop_pages  # noqa: E402
from benchmarks.trace_bound import one_repeat  # noqa: E402


def pool_replay(trace_path, *, gap_s: float, passes: int) -> dict:
    """{"bytes", "seconds", "s_per_token"} of the last repeat of a trace, replayed `passes` times."""
    head, records = read_trace(trace_path)
    records = one_repeat(records)
    if not records:
        raise ValueError(f"{trace_path}: the trace has no reads")
    mode = head.get("io_mode_effective") or head["io_mode"]
    tokens: dict[int, list[dict]] = collections.defaultdict(list)
    for r in records:
        tokens[r["token"]].append(r)
    qd = head["io_threads"]
    window = 2 * qd  # spans queued: enough to keep every reader busy; the readers bound the device QD
    got = 0
    with ReadPool(mode, qd, head["chunk_size"]) as pool:
        slot = max(pool.buffer_bytes(r["span_offset"], r["span_length"]) for r in records)
        arena = SlotArena(slot, window) if mode == "direct" else None
        drop_pages(sorted({r["file"] for r in records}))
        inflight: collections.deque = collections.deque()
        t0 = last = time.perf_counter()
        for _ in range(passes):
            for token in sorted(tokens):
                pause = last + gap_s - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                for r in tokens[token]:
                    if len(inflight) == window:
                        got += _land(inflight)
                    lease = arena.acquire(wait_s=5.0) if arena is not None else None
                    inflight.append((pool.submit(r["file"], r["span_offset"], r["span_length"], into=lease), lease))
                    del lease
                    last = time.perf_counter()
        while inflight:
            got += _land(inflight)
        seconds = time.perf_counter() - t0
        read = pool.stats.snapshot()["bytes_read"]
    return {"bytes": read, "span_bytes": got, "seconds": seconds, "s_per_token": seconds / (passes * head["tokens"])}


def _land(inflight) -> int:
    future, lease = inflight.popleft()
    n = len(future.result())
    del future, lease  # the slot goes back to the arena with its last reference
    return n


def main() -> int:
    import shutil
    from benchmarks.trace_bound import replay_trace
    from engine.base.config import parse_size
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gap-s", type=float, default=0.024)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--with-fio", action="store_true", help="interleave fio psync replays of the same trace")
    ap.add_argument("--budget", default="1GiB", help="the cgroup limit of the fio jobs")
    a = ap.parse_args()
    try:
        read_trace(a.trace)
    except (OSError, ValueError) as exc:
        print(f"pool_replay: error: {exc}", file=sys.stderr)
        return 2
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}, "
          f"gap {a.gap_s * 1e3:.1f} ms, {a.passes} passes\n\n| reader | replay s | GB/s | s/token |\n|---|---|---|---|")
    fio = shutil.which("fio") if a.with_fio else None
    for _ in range(a.repeats):
        runs = [("engine pool", lambda: pool_replay(a.trace, gap_s=a.gap_s, passes=a.passes))]
        if fio:
            runs.append(("fio psync", lambda: replay_trace(fio, a.trace, gap_s=a.gap_s, passes=a.passes,
                                                           limit_bytes=parse_size(a.budget))))
        for name, run in runs:
            r = run()
            print(f"| {name} | {r['seconds']:.2f} | {r['bytes'] / r['seconds'] / 1e9:.2f} | {r['s_per_token']:.4f} |",
                  flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
