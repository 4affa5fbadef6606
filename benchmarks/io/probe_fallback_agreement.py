"""How closely the Python O_DIRECT fallback agrees with fio on the storage probe's jobs.

Both runners read the same test file at the same points (the default probe plan: random reads
64 KiB-16 MiB at QD 1/4/16, sequential, 4 KiB latency and IOPS, buffered), interleaved
(fio, fallback, fio, fallback, ...) so drift in a shared or virtual disk hits both alike, and
the median of the repeats is compared. Prints a table; exits non-zero only if a runner fails.

    .venv/bin/python benchmarks/io/probe_fallback_agreement.py --dir /models --repeats 3 [--json] [--lock FILE]

--json prints the same rows (bytes/s and µs as measured, not rounded) as one colibri.bench/1
document (benchkit.emit); --lock FILE holds benchkit.bench_lock over the measured runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions, spread  # noqa: E402
from tuner.probe import fallback, fio  # noqa: E402
from tuner.probe.storage import (  # noqa: E402
    MiB, check_directory, check_writable, choose_file_bytes, free_bytes, scratch_file,
    sigterm_as_interrupt, storage_plan)

TOOL = "probe_fallback_agreement"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="directory on the disk to measure")
    ap.add_argument("--runtime", type=float, default=1.0, help="seconds per job")
    ap.add_argument("--repeats", type=int, default=3, help="runs per runner and point")
    ap.add_argument("--file-mib", type=int, default=512, help="test file size")
    add_output_flags(ap)
    args = ap.parse_args(argv)

    fio_bin = fio.find_fio()
    if fio_bin is None:
        print("fio is not installed: nothing to compare the fallback with", file=sys.stderr)
        return 2
    directory = check_directory(Path(args.dir))
    check_writable(directory)
    plan = storage_plan(quick=False)
    file_bytes = choose_file_bytes(
        plan.__class__(file_bytes=args.file_mib * MiB, runtime_s=args.runtime, jobs=plan.jobs),
        free_bytes(directory), directory)

    rows = []
    started = time.perf_counter()
    with sigterm_as_interrupt(), scratch_file(directory, file_bytes) as path, bench_lock(args.lock):
        first, engine = fio.run_first_job(fio_bin, plan.jobs[0], path, file_bytes, args.runtime)
        for i, job in enumerate(plan.jobs):
            print(f"[{i + 1}/{len(plan.jobs)}] {job.label} ...", file=sys.stderr)
            f_runs, p_runs = [], []
            for r in range(args.repeats):
                f_runs.append(first if (i == 0 and r == 0) else
                              fio.run_job(fio_bin, job, path, file_bytes, args.runtime, engine))
                p_runs.append(fallback.run_job(job, path, file_bytes, args.runtime, seed=r))
            rows.append((job, f_runs, p_runs))
    elapsed = time.perf_counter() - started
    if args.json:
        emit(TOOL, json_rows(rows), run_conditions(args, fio=f"{fio.fio_version(fio_bin)}, {engine}",
                                                  fallback=fallback.TOOL, file_bytes=file_bytes,
                                                  directory=str(directory), elapsed_s=round(elapsed, 1)), True, [])
        return 0

    print(f"fio ({fio.fio_version(fio_bin)}, {engine}) vs Python fallback ({fallback.TOOL}); "
          f"{file_bytes // MiB} MiB test file in {directory}; {args.runtime:g} s per job; "
          f"median of {args.repeats} interleaved runs each; {elapsed:.0f} s in all\n")
    header = ["job", "fio GB/s", "fallback GB/s", "ratio", "fio spread", "fb spread",
              "fio p50 µs", "fb p50 µs"]
    table = []
    ratios = []
    for job, f_runs, p_runs in rows:
        f_bw = [p.bandwidth.value for p in f_runs]
        p_bw = [p.bandwidth.value for p in p_runs]
        ratio = statistics.median(p_bw) / statistics.median(f_bw)
        if job.role == "curve":
            ratios.append(ratio)
        table.append([
            f"{job.role:10s} {job.label}",
            f"{statistics.median(f_bw) / 1e9:.3f}", f"{statistics.median(p_bw) / 1e9:.3f}",
            f"{ratio:.2f}", _spread(f_bw), _spread(p_bw),
            f"{statistics.median(p.lat_p50.value for p in f_runs):,.0f}",
            f"{statistics.median(p.lat_p50.value for p in p_runs):,.0f}"])
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))
    if ratios:
        print(f"\nrandom-read curve, fallback/fio ratio: median {statistics.median(ratios):.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} points")
    print("spread = (max - min) / median of the repeats")
    return 0


def json_rows(rows) -> list[dict]:
    """The table's rows for --json: per job, each runner's bandwidth (bytes/s) and p50 latency (µs)
    as median and min-max over the repeats, and the fallback/fio ratio of the medians."""
    out = []
    for job, f_runs, p_runs in rows:
        f_bw, p_bw = [p.bandwidth.value for p in f_runs], [p.bandwidth.value for p in p_runs]
        out.append({"role": job.role, "job": job.label, "fio_bytes_s": spread(f_bw), "fallback_bytes_s": spread(p_bw),
                    "ratio": statistics.median(p_bw) / statistics.median(f_bw),
                    "fio_p50_us": spread(p.lat_p50.value for p in f_runs),
                    "fallback_p50_us": spread(p.lat_p50.value for p in p_runs)})
    return out


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{(max(values) - min(values)) / med * 100:.0f}%" if med > 0 else "-"


if __name__ == "__main__":
    sys.exit(main())
