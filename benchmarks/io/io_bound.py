"""The I/O bound tool: what this disk delivers at the engine's own read pattern.

Three measurements, one command each (the jobs themselves are in benchmarks/io/io_jobs.py):

    fio     continuous fio at one (request, QD, mode): one long job with a per-second bandwidth
            trace, then repeated jobs of several lengths, interleaved — the stability study that
            picked streaming_roofline.py's 10 s fio job (docs/BENCHMARKS.md, "fio job length").
    replay  fio replays of one `colibri bench --read-trace` file at several lengths (passes of
            the trace), paced by --gap-s (the resident compute per token: the bound's shape) or
            --no-stall, io_threads psync jobs or one shared libaio queue.
    pool    the same trace through the engine's own ReadPool (--with-fio: interleaved with fio's
            paced replay of it), so a gap between the two is the I/O path, not the load shape.

Why the trace: on this virtual disk fio's continuous random load measures ~1.1-1.3 GB/s, yet
the engine, which reads in bursts between compute, often reads faster; the disk's rate depends
on its recent load ("The bound, and why fio alone does not make it sturdy on this disk"), so
the streaming bound's disk term is measured under the engine's load. benchmarks/io/streaming_roofline.py
--trace-bound builds its rows with `measure_row` / `finish_row` / `print_rows` below.

    python benchmarks/io/io_bound.py fio [--model demo] [--request 1MiB] [--qd 4] [--mode direct]
        [--trace-seconds 40] [--lengths 2 4 8 16] [--repeats 3] [--budget 1GiB] [--region 256MiB] [--json]
    python benchmarks/io/io_bound.py replay TRACE [--passes 1 3] [--repeats 2] [--gap-s 0.05]
        [--no-stall] [--queue psync shared] [--budget 1GiB] [--json]
    python benchmarks/io/io_bound.py pool TRACE [--gap-s 0.024] [--passes 4] [--repeats 2] [--with-fio] [--json]

Each needs fio except `pool` without --with-fio (apt-get install fio).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.api import format_size, parse_size, resolve_model  # noqa: E402
from engine.api.lab import read_trace  # noqa: E402
from benchmarks.benchkit import conditions, emit, refuse  # noqa: E402
from benchmarks.io.io_jobs import fio_run, one_repeat, outstanding_fraction, pool_replay, replay_trace  # noqa: E402

TOOL = "io_bound"


# --- one row of benchmarks/io/streaming_roofline.py --trace-bound -------------------------------------------------


def measure_row(name: str, cfg, *, stream, fio: str, files, limit: int | None, request: int, fio_seconds: float,
                compute_s: float, passes: int, traces: dict, trace_dir) -> dict:
    """old fio, paced replay, stream (recording its trace), paced replay, old fio, no-stall replay.

    The paced replays sit right before and right after the streaming run: the before-job
    replays the trace of this config's previous run (the first run records one in a warm-up
    streaming run, not reported), the after-job the trace the streaming run just recorded.
    The old continuous fio jobs at the request size (`io_bound.py fio`) go around them."""
    slug = "".join(c if c.isalnum() else "-" for c in name)
    done = len([k for k in traces if k[0] == name])

    def old_fio():
        return fio_run(fio, files, request, cfg.io_threads, cfg.io_mode, fio_seconds, limit)["bw"]

    def paced(path):
        return replay_trace(fio, path, gap_s=compute_s, passes=passes, limit_bytes=limit)

    previous = traces.get((name, done - 1))
    warmup = None
    try:
        if previous is None:
            previous = Path(trace_dir) / f"{slug}-warmup.jsonl"
            warmup = stream(["--read-trace", str(previous)])
            if "error" in warmup:
                return warmup
        fio_before = old_fio()
        before = paced(previous)
        this = Path(trace_dir) / f"{slug}-run{done + 1}.jsonl"
        row = stream(["--read-trace", str(this)])
        if "error" in row:
            return row
        after = paced(this)
        fio_after = old_fio()
        no_stall = replay_trace(fio, this, gap_s=0.0, passes=passes, limit_bytes=limit, no_stall=True)
    except (ValueError, RuntimeError) as exc:
        return {"name": name, "side": "after", "error": f"trace bound: {exc}"}
    traces[(name, done)] = this
    head, records = read_trace(this)
    last = one_repeat(records)
    row.update(bw=(fio_before + fio_after) / 2, fio=(fio_before, fio_after), request=request,
               replay=(before, after), no_stall=no_stall, gap_s=compute_s, trace=str(this),
               trace_bytes_per_token=sum(r["nbytes"] for r in last) / head["tokens"],
               outstanding=outstanding_fraction(last, head["window_s"][-1]),
               warmup_tok_s=warmup["tok_s"] if warmup else None)
    return row


def finish_row(row: dict, compute_s: float) -> None:
    """The bound (declared before the 3-run test): the mean of the two paced replays' s/token.
    The old bound (continuous fio at the request size + compute) and the no-stall replay's
    (its rate + compute) are kept next to it."""
    old_s = row["bytes_per_token"] / row["bw"] + compute_s
    no_stall_s = row["bytes_per_token"] / row["no_stall"]["bw"] + compute_s
    bound_s = sum(r["s_per_token"] for r in row["replay"]) / 2
    row.update(old_bound_tok_s=1 / old_s, old_ratio=row["tok_s"] * old_s, no_stall_bound_tok_s=1 / no_stall_s,
               no_stall_ratio=row["tok_s"] * no_stall_s, bound_tok_s=1 / bound_s, ratio=row["tok_s"] * bound_s)


def print_rows(rows: list[dict]) -> None:
    """The --trace-bound table: the pre-registered bound first, the old one next to it."""
    resident = [r for r in rows if r.get("io") == "resident"]
    if resident:
        runs = " ".join(f"{v:.3f}" for v in resident[0].get("resident_tok_s", [resident[0]["tok_s"]]))
        print(f"resident tok/s (start, end): {runs}\n")
    print("| config | decode tok/s | MiB/token (trace) | engine read GB/s | reads outstanding | compute gap ms "
          "| paced replay s/token before / after (mean) | **bound tok/s** | **measured/bound** "
          "| no-stall replay GB/s -> bound, ratio | old fio GB/s before / after (mean) -> bound, ratio "
          "| I/O stall | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("io") == "resident":
            continue
        if "error" in r:
            print(f"| {r['name']} | {r['error']} |" + " |" * 11)
            continue
        b, a = (x["s_per_token"] for x in r["replay"])
        fb, fa = r["fio"]
        print(f"| {r['name']} | {r['tok_s']:.3f} | {r['bytes_per_token'] / 2**20:.0f} "
              f"({r['trace_bytes_per_token'] / 2**20:.0f}) | {r.get('read_gbps') or 0:.2f} | {r['outstanding']:.0%} "
              f"| {r['gap_s'] * 1e3:.1f} | {b:.4f} / {a:.4f} ({(a + b) / 2:.4f}) | **{r['bound_tok_s']:.3f}** "
              f"| **{r['ratio']:.2f}** | {r['no_stall']['bw'] / 1e9:.2f} -> {r['no_stall_bound_tok_s']:.3f}, "
              f"{r['no_stall_ratio']:.2f} | {fb / 1e9:.2f} / {fa / 1e9:.2f} ({r['bw'] / 1e9:.2f}) -> "
              f"{r['old_bound_tok_s']:.3f}, {r['old_ratio']:.2f} | {r['stall'] or 0:.0%} "
              f"| {r.get('load_avg_1m', float('nan')):.1f} |")


# --- the command line ------------------------------------------------------------------------------


def _fio_study(a, fio: str) -> int:
    files = sorted(Path(resolve_model(a.model)).glob("*.safetensors"))
    if not files:
        return refuse(TOOL, f"{a.model}: no .safetensors shards")
    request, limit = parse_size(a.request), parse_size(a.budget)
    region = parse_size(a.region) if a.region else None
    cond = conditions(io_mode=a.mode, request=format_size(request), qd=a.qd, cgroup_limit=a.budget,
                      read=f"first {format_size(region)} of one shard" if region else "all shards",
                      repeats=a.repeats)
    notes = {}
    if a.trace_seconds:
        trace = fio_run(fio, files, request, a.qd, a.mode, a.trace_seconds, limit, log=True, region=region)["trace"]
        notes[f"MB/s per second of one {a.trace_seconds:g} s job"] = " ".join(f"{v:.0f}" for v in trace)
    per_length: dict[float, list[float]] = {length: [] for length in a.lengths}
    for _ in range(a.repeats):  # lengths interleaved, so a drift of the disk hits each alike
        for length in a.lengths:
            per_length[length].append(fio_run(fio, files, request, a.qd, a.mode, length, limit, region=region)["bw"])
    rows = [{"length_s": length, "gbps": [v / 1e9 for v in vals], "mean_gbps": statistics.mean(vals) / 1e9,
             "spread": (max(vals) - min(vals)) / statistics.mean(vals)} for length, vals in per_length.items()]
    cond["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    emit(TOOL, rows, cond, a.json, [
        ("job length s", lambda r: f"{r['length_s']:g}"),
        ("GB/s per job", lambda r: " ".join(f"{v:.2f}" for v in r["gbps"])),
        ("mean", lambda r: f"{r['mean_gbps']:.2f}"),
        ("spread (max-min)/mean", lambda r: f"{r['spread']:.0%}")], notes=notes)
    return 0


def _trace_note(path) -> dict:
    head, records = read_trace(path)
    last = one_repeat(records)
    window = head["window_s"][-1]
    return {"trace": f"{path}: {len(last)} reads, {sum(r['nbytes'] for r in last) / 2**20:.0f} MiB, "
                     f"{head['tokens']} tokens in {window:.2f} s, reads outstanding "
                     f"{outstanding_fraction(last, window):.0%} of it"}


_REPLAY_COLUMNS = [
    ("reader", lambda r: r["reader"]), ("passes", lambda r: r["passes"]), ("queue", lambda r: r.get("queue")),
    ("shape", lambda r: r["shape"]), ("replay s", lambda r: f"{r['seconds']:.2f}"),
    ("GB/s", lambda r: f"{r['bytes'] / r['seconds'] / 1e9:.2f}"), ("s/token", lambda r: f"{r['s_per_token']:.4f}")]


def _replay(a, fio: str) -> int:
    notes = _trace_note(a.trace)
    cond = conditions(cgroup_limit=a.budget, gap_ms=a.gap_s * 1e3, repeats=a.repeats)
    rows = []
    for _ in range(a.repeats):
        for passes in a.passes:
            for queue in a.queue:
                r = replay_trace(fio, a.trace, gap_s=a.gap_s, passes=passes, limit_bytes=parse_size(a.budget),
                                 no_stall=a.no_stall, queue=queue)
                rows.append({"reader": "fio", "queue": queue, **r})
                print(f"{passes} passes {queue}: {r['s_per_token']:.4f} s/token", file=sys.stderr, flush=True)
    emit(TOOL, rows, cond, a.json, _REPLAY_COLUMNS, notes=notes)
    return 0


def _pool(a, fio: str | None) -> int:
    notes = _trace_note(a.trace)
    cond = conditions(cgroup_limit=a.budget, gap_ms=a.gap_s * 1e3, repeats=a.repeats)
    rows = []
    for _ in range(a.repeats):
        rows.append({"reader": "engine pool", "shape": "paced", "passes": a.passes,
                     **pool_replay(a.trace, gap_s=a.gap_s, passes=a.passes)})
        if fio:
            rows.append({"reader": "fio", "queue": "psync", **replay_trace(
                fio, a.trace, gap_s=a.gap_s, passes=a.passes, limit_bytes=parse_size(a.budget))})
    emit(TOOL, rows, cond, a.json, _REPLAY_COLUMNS, notes=notes)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="io_bound.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fio", help="continuous fio at one pattern: a per-second trace, then jobs of several lengths")
    f.add_argument("--model", default="demo")
    f.add_argument("--request", default="1MiB")
    f.add_argument("--qd", type=int, default=4)
    f.add_argument("--mode", choices=("direct", "buffered", "mmap"), default="direct")
    f.add_argument("--trace-seconds", type=float, default=40)
    f.add_argument("--lengths", type=float, nargs="*", default=[2, 4, 8, 16])
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--region", help="read only this many bytes of the first shard (a hot set), e.g. 256MiB")
    r = sub.add_parser("replay", help="fio replays of a read trace")
    r.add_argument("trace", help="a colibri bench --read-trace file")
    r.add_argument("--passes", type=int, nargs="*", default=[1, 3], help="replay lengths, in passes of the trace")
    r.add_argument("--repeats", type=int, default=2, help="jobs per length (lengths interleaved)")
    r.add_argument("--gap-s", type=float, default=0.05, help="the paced shape's compute gap per token")
    r.add_argument("--no-stall", action="store_true", help="replay back-to-back instead of paced")
    r.add_argument("--queue", nargs="*", choices=("psync", "shared"), default=["psync"],
                   help="io_threads psync jobs, or one libaio job at iodepth io_threads")
    p = sub.add_parser("pool", help="a read trace through the engine's own reader")
    p.add_argument("trace", help="a colibri bench --read-trace file")
    p.add_argument("--gap-s", type=float, default=0.024)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--with-fio", action="store_true", help="interleave fio psync replays of the same trace")
    for s in (f, r, p):
        s.add_argument("--budget", default="1GiB", help="the cgroup limit of each fio job")
        s.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.command != "fio":
        try:
            read_trace(a.trace)
        except (OSError, ValueError) as exc:
            return refuse(TOOL, str(exc))
    fio = shutil.which("fio") if a.command != "pool" or a.with_fio else None
    if fio is None and (a.command != "pool" or a.with_fio):
        return refuse(TOOL, "fio not found (apt-get install fio)")
    return {"fio": _fio_study, "replay": _replay, "pool": _pool}[a.command](a, fio)


if __name__ == "__main__":
    sys.exit(main())
