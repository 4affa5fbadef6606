"""Kernel-side cost of one cold `colibri bench`: page faults, context switches, futex/mmap calls.

The hot path's memory and locking show up here before they show up in tok/s: fresh anonymous
buffers per read cost a zero-fill fault per 4 KiB page and an munmap per eviction; one future
per chunk costs futex calls and context switches. This runs the same bench under `perf stat`
and under `strace -c -f` for each source tree given (the "before" checkout and this one), so
both sides are measured in one script run.

    python benchmarks/syscall_counts.py [--src DIR ...] [--chunk-sizes 1MiB 4MiB] [--model demo]
        [--budget 1GiB] [--tokens 8]

--chunk-sizes runs each tree once per chunk_size (the demo's 3 MiB expert span is split across
the readers at 1 MiB and read with one request at 4 MiB).

Needs `perf` and `strace` (Debian: apt-get install linux-perf strace).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF_EVENTS = ("page-faults", "minor-faults", "major-faults", "context-switches", "cpu-migrations")
SYSCALLS = ("futex", "preadv2", "preadv", "pread64", "mmap", "munmap", "madvise", "io_uring_enter")


def bench_cmd(args, chunk: str | None) -> list[str]:
    return [sys.executable, "-m", "tuner.cli", "bench", "--model", args.model, "--ram-budget", args.budget,
            "--cold", "--tokens", str(args.tokens), "--repeats", "1", "--json",
            *(["--chunk-size", chunk] if chunk else []), *args.extra]


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src)}


def perf_counts(src: Path, args, chunk) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".csv") as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(["perf", "stat", "-x", ",", "-o", out.name, "-e", ",".join(PERF_EVENTS),
                               *bench_cmd(args, chunk)], cwd=src, env=_env(src), capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"bench under perf failed in {src}: {proc.stderr.strip()[-400:]}")
        counts = {}
        for line in Path(out.name).read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[2] in PERF_EVENTS and parts[0].strip().isdigit():
                counts[parts[2]] = int(parts[0])
    result = json.loads(proc.stdout)
    counts["user_s"] = after.ru_utime - before.ru_utime
    counts["sys_s"] = after.ru_stime - before.ru_stime
    counts["decode_tok_s"] = result.get("decode_tok_s")
    counts["bytes_read_per_token"] = result.get("bytes_read_per_token")
    counts["git_commit"] = result.get("git_commit")
    return counts


def strace_counts(src: Path, args, chunk) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as out:
        proc = subprocess.run(["strace", "-c", "-f", "-o", out.name, *bench_cmd(args, chunk)], cwd=src, env=_env(src),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench under strace failed in {src}: {proc.stderr.strip()[-400:]}")
        text = Path(out.name).read_text()
    calls = {}
    # strace -c rows: % time, seconds, usecs/call, calls, [errors], syscall
    for line in text.splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m:
            calls[m.group(2)] = int(m.group(1))
    return {name: calls.get(name, 0) for name in SYSCALLS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", nargs="+", default=[str(ROOT)], help="source trees to measure (e.g. the old checkout)")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--chunk-sizes", nargs="+", default=[None], help="run each tree once per chunk_size")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more bench flags")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for tool in ("perf", "strace"):
        if shutil.which(tool) is None:
            print(f"syscall_counts: error: {tool} not found (apt-get install linux-perf strace)", file=sys.stderr)
            return 2
    rows = []
    for src in a.src:
        src = Path(src).resolve()
        for chunk in a.chunk_sizes:
            print(f"measuring {src} chunk {chunk or 'default'} ...", file=sys.stderr)
            rows.append({"src": str(src), "chunk_size": chunk or "default", "load_avg_1m": os.getloadavg()[0],
                         **perf_counts(src, a, chunk), **strace_counts(src, a, chunk)})
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    cols = ["git_commit", "chunk_size", "decode_tok_s", "user_s", "sys_s", *PERF_EVENTS, *SYSCALLS]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
