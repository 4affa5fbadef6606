"""fio at the engine's own read pattern: the disk term of benchmarks/streaming.py's bound.

The pattern of one streaming config is (request, QD, mode): request = the size of one read
the engine issues for an expert span (this tree: the whole span, split into min(io_threads,
span / chunk_size) pieces only past chunk_size; a tree from before one-read-per-span: chunk
sized pieces), QD = io_threads synchronous readers (fio psync jobs, one in flight each), mode =
O_DIRECT, buffered or mmap as the config. Each job runs inside a memory cgroup limited to the
engine's budget, so buffered and mmap reads cannot be served from a page cache larger than the
engine itself could hold; the model's pages are dropped before every job.

Run as a script it is the stability study that picks the job length (docs/BENCHMARKS.md):
one long job with a per-interval bandwidth log, then repeated jobs of several lengths.

    python benchmarks/fio_bound.py [--model demo] [--request 1MiB] [--qd 4] [--mode direct]
        [--trace-seconds 40] [--lengths 2 4 8 16] [--repeats 3] [--budget 1GiB] [--region 256MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.base.config import format_size, parse_size  # noqa: E402

BLOCK = 4096


def request_bytes(chunk_size: int, io_threads: int, span_bytes: int, old_tree: bool) -> int:
    """The size of one read request the engine issues for one expert span."""
    if old_tree:
        return min(chunk_size, span_bytes)
    pieces = min(io_threads, -(-span_bytes // chunk_size))
    return span_bytes if pieces <= 1 else -(-span_bytes // pieces)


def drop_pages(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fio_argv(fio: str, files, request: int, qd: int, mode: str, seconds: float, log_prefix: str | None = None,
             region: int | None = None):
    request = -(-request // BLOCK) * BLOCK  # fio wants block multiples for O_DIRECT
    if region:  # only the first `region` bytes of the first shard: a small hot set, read over and over
        files = files[:1]
    argv = [fio, "--name=bound", "--filename=" + ":".join(str(f) for f in files), "--readonly",
            *([f"--size={region}"] if region else []),
            "--rw=randread", f"--bs={request}", f"--ioengine={'mmap' if mode == 'mmap' else 'psync'}",
            f"--numjobs={qd}", f"--direct={1 if mode == 'direct' else 0}", "--invalidate=1",
            "--group_reporting", "--time_based", f"--runtime={seconds:g}", "--ramp_time=1",
            "--output-format=json"]
    if log_prefix:
        argv += [f"--write_bw_log={log_prefix}", "--log_avg_msec=1000"]
    return argv


def fio_run(fio: str, files, request: int, qd: int, mode: str, seconds: float, limit_bytes: int | None,
            log: bool = False, region: int | None = None) -> dict:
    """One fio job. Returns {"bw": bytes/s, "trace": [MB/s per second summed over jobs]}."""
    from tuner.sandbox import run_limited
    drop_pages(files)
    with tempfile.TemporaryDirectory(prefix="colibri-fio-") as tmp:
        prefix = str(Path(tmp) / "bw") if log else None
        run = run_limited(fio_argv(fio, files, request, qd, mode, seconds, prefix, region), limit_bytes,
                          timeout=seconds + 120, cwd=tmp)
        if run.returncode != 0:
            raise SystemExit(f"fio failed: {run.stderr.strip()[-300:]}")
        doc = json.loads(run.stdout[run.stdout.index("{"):])
        trace = _trace(Path(tmp).glob("bw_bw.*.log")) if log else []
    return {"bw": float(doc["jobs"][0]["read"]["bw_bytes"]), "trace": trace}


def _trace(logs) -> list[float]:
    """Per-second MB/s summed over the jobs' own logs (one line per second per job, KiB/s)."""
    per_second: dict[int, float] = {}
    for path in logs:
        for line in path.read_text().splitlines():
            ms, kib_s = (int(v) for v in line.split(",")[:2])
            second = round(ms / 1000)
            per_second[second] = per_second.get(second, 0.0) + kib_s * 1024 / 1e6
    return [per_second[s] for s in sorted(per_second)]


def main() -> int:
    from engine.run.resolve import resolve_model
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--request", default="1MiB")
    ap.add_argument("--qd", type=int, default=4)
    ap.add_argument("--mode", choices=("direct", "buffered", "mmap"), default="direct")
    ap.add_argument("--budget", default="1GiB", help="the cgroup limit of each fio job")
    ap.add_argument("--trace-seconds", type=float, default=40)
    ap.add_argument("--lengths", type=float, nargs="*", default=[2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--region", help="read only this many bytes of the first shard (a hot set), e.g. 256MiB")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    fio = shutil.which("fio")
    if fio is None:
        print("fio_bound: error: fio not found (apt-get install fio)", file=sys.stderr)
        return 2
    files = sorted(Path(resolve_model(a.model)).glob("*.safetensors"))
    request, limit = parse_size(a.request), parse_size(a.budget)
    region = parse_size(a.region) if a.region else None
    out = {"request": request, "qd": a.qd, "mode": a.mode, "load_avg_1m_start": os.getloadavg()[0],
           "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if a.trace_seconds:
        out["trace"] = fio_run(fio, files, request, a.qd, a.mode, a.trace_seconds, limit, log=True, region=region)
    rows = {length: [] for length in a.lengths}
    for _ in range(a.repeats):  # lengths interleaved, so a drift of the disk hits each alike
        for length in a.lengths:
            rows[length].append(fio_run(fio, files, request, a.qd, a.mode, length, limit, region=region)["bw"])
    out["lengths"] = rows
    out["load_avg_1m_end"] = os.getloadavg()[0]
    if a.json:
        json.dump(out, sys.stdout, indent=2)
        return 0
    where = f"first {format_size(region)} of one shard" if region else "all shards"
    print(f"fio {a.mode}, request {format_size(request)}, QD {a.qd}, {where}, cgroup {a.budget}, {out['start']}, "
          f"load {out['load_avg_1m_start']:.1f} -> {out['load_avg_1m_end']:.1f}")
    if a.trace_seconds:
        trace = out["trace"]["trace"]
        print(f"\ntrace of one {a.trace_seconds:g} s job, MB/s per second: " + " ".join(f"{v:.0f}" for v in trace))
    print("\n| job length s | GB/s per job | mean | spread (max-min)/mean |")
    print("|---|---|---|---|")
    for length, vals in rows.items():
        mean = statistics.mean(vals)
        print(f"| {length:g} | {' '.join(f'{v / 1e9:.2f}' for v in vals)} | {mean / 1e9:.2f} | "
              f"{(max(vals) - min(vals)) / mean:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
