"""The streaming bound's disk term from the engine's own read trace, replayed by fio.

Why: on this virtual disk fio's continuous random load (benchmarks/fio_bound.py) measures
~1.1-1.3 GB/s, yet the engine, which reads in bursts between compute, often reads faster, and
a continuous fio job right after a streaming run sometimes measured 2.2-2.3 GB/s: the disk's
rate depends on its recent load (docs/BENCHMARKS.md, "The bound, and why fio alone does not
make it sturdy on this disk"). So the disk term has to be measured under the engine's load.

What is replayed: `colibri bench --read-trace` records every decode read (engine/movement/io/trace.py):
file, device window, submit/complete times, token, layer. Each read is split exactly as the
pool splits a span (at most io_threads pieces, only past chunk_size) and the pieces are dealt
round-robin, in submit order, to io_threads fio psync jobs, one fio version 3 iolog each: the
engine's io_threads synchronous readers, its exact requests (file, offset, size) in its order,
O_DIRECT or buffered as the config, inside the budget's cgroup, the pages dropped first.

Two load shapes, both of this trace:
  paced     the engine's tokens one after another: before each token's reads an idle gap of
            the resident compute per token (the same tree with the weights in RAM), then the
            token's reads back-to-back at QD io_threads. fio's v3 delays count from a job's
            previous issue, so the gap starts when a job issued its last read of the token,
            overlapping that read (~10 ms at 3 MiB); otherwise this is a serial engine that
            reads a token, then computes it at resident speed. The replay's wall time per
            token is that engine's s/token on this disk under this load shape: the bound.
  no_stall  the same requests as fast as the QD allows (replay_no_stall): the disk's rate
            under continuous load at the engine's own requests; printed for comparison.

A trace of a few tokens replays in ~2 s; `passes` repeats its tokens (same gaps) so a job is
long enough to be stable (docs/BENCHMARKS.md says how long and why).

    python benchmarks/trace_bound.py TRACE [--passes 1 3] [--repeats 2] [--gap-s 0.05] [--budget 1GiB]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.base.config import parse_size  # noqa: E402
from engine.base.align import align_down, align_up  # noqa: E402
from engine.movement.io.trace import read_trace  # noqa: E402
from benchmarks.fio_bound import drop_pages  # noqa: E402

IOLOG_HEADER = "fio version 3 iolog"
# fio ignores the delay of a line that follows a timestamp 0 (it reads 0 as "no previous line"),
# so the file actions sit at 1 us and every read after them.
T_START_US = 1


def split_window(offset: int, nbytes: int, io_threads: int, chunk_size: int, direct: bool) -> list[tuple[int, int]]:
    """The pieces the pool reads one window in (engine/movement/io/pool.py ReadPool._pieces): one read,
    unless the window is larger than chunk_size, then at most io_threads page-aligned pieces."""
    chunk = align_up(chunk_size) if direct else chunk_size
    n = min(io_threads, -(-nbytes // chunk))
    if n <= 1:
        return [(offset, nbytes)]
    step = align_up(-(-nbytes // n))
    stop = offset + nbytes
    return [(p, min(p + step, stop) - p) for p in range(offset, stop, step)]


def one_repeat(records: list[dict], repeat: int | None = None) -> list[dict]:
    """The records of one repeat (the last by default), in submit order."""
    repeats = sorted({r.get("repeat", 0) for r in records})
    want = repeats[-1] if repeat is None and repeats else repeat
    return sorted((r for r in records if r.get("repeat", 0) == want), key=lambda r: r["submit_s"])


def job_iologs(records: list[dict], *, jobs: int, io_threads: int, chunk_size: int, direct: bool,
               gap_s: float = 0.0, passes: int = 1) -> list[str]:
    """One fio v3 iolog per psync job: the trace's tokens `passes` times, each token's pieces
    dealt round-robin to the jobs, an idle gap of gap_s before each job's first read of a token.

    An O_DIRECT window that runs past the end of its file (the last expert of a shard) ends
    short there for the engine, which takes the short read; fio fails the job on it, so such a
    piece is cut at the file's last whole 4 KiB block (less than 4 KiB of ~250 MiB a token)."""
    tokens: dict[int, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["submit_s"]):
        tokens.setdefault(r["token"], []).append(r)
    files = sorted({r["file"] for r in records})
    sizes = {f: os.path.getsize(f) for f in files} if direct else {}
    for f in files:
        if any(c.isspace() for c in f):
            raise ValueError(f"fio iologs cannot name a file with whitespace: {f!r}")
    gap_us = round(gap_s * 1e6)
    clock = [T_START_US] * jobs
    lines: list[list[str]] = [[IOLOG_HEADER] + [f"{T_START_US} {f} {a}" for f in files for a in ("add", "open")]
                              for _ in range(jobs)]
    turn = 0
    for _ in range(passes):
        for token in sorted(tokens):
            started = [False] * jobs
            for r in tokens[token]:
                for off, length in split_window(r["offset"], r["nbytes"], io_threads, chunk_size, direct):
                    if direct and off + length > sizes[r["file"]]:
                        length = align_down(sizes[r["file"]] - off)
                        if length <= 0:
                            continue
                    j = turn % jobs
                    turn += 1
                    if not started[j]:
                        started[j] = True
                        clock[j] += gap_us
                    lines[j].append(f"{clock[j]} {r['file']} read {off} {length}")
    for j in range(jobs):
        lines[j] += [f"{clock[j]} {f} close" for f in files]
    return ["\n".join(job) + "\n" for job in lines]


def replay(fio: str, iologs: list[str], mode: str, limit_bytes: int | None, files, no_stall: bool = False,
           timeout: float = 300, iodepth: int = 1) -> dict:
    """Run the iologs as one group of jobs: psync ones (iodepth 1), or libaio ones holding up to
    `iodepth` reads in flight each. {"bytes", "ios", "seconds" (the group's run time), "bw"}.

    A libaio replay stops when its last read is issued: the reads still in flight then (at
    most iodepth - 1) complete but are not in fio's byte count, so "bytes" can fall short of
    the log's by those; "ios" counts every read."""
    from tuner.sandbox import run_limited
    if mode not in ("direct", "buffered"):
        raise ValueError(f"a trace replay models pread reads (direct, buffered), not {mode!r}")
    drop_pages(files)
    with tempfile.TemporaryDirectory(prefix="colibri-replay-") as tmp:
        engine = ["ioengine=psync"] if iodepth <= 1 else ["ioengine=libaio", f"iodepth={iodepth}"]
        job = ["[global]", *engine, f"direct={1 if mode == 'direct' else 0}", "group_reporting=1",
               f"replay_no_stall={1 if no_stall else 0}"]
        for i, text in enumerate(iologs):
            path = Path(tmp) / f"reader{i}.iolog"
            path.write_text(text)
            job += [f"[reader{i}]", f"read_iolog={path}"]
        (Path(tmp) / "replay.fio").write_text("\n".join(job) + "\n")
        run = run_limited([fio, "--readonly", "--output-format=json", "replay.fio"], limit_bytes,
                          timeout=timeout, cwd=tmp)
        if run.returncode != 0:
            raise RuntimeError(f"fio replay failed: {(run.stderr or run.stdout).strip()[-300:]}")
        doc = json.loads(run.stdout[run.stdout.index("{"):])
    read = doc["jobs"][0]["read"]
    seconds = read["runtime"] / 1000
    return {"bytes": int(read["io_bytes"]), "ios": int(read["total_ios"]), "seconds": seconds,
            "bw": read["io_bytes"] / seconds if seconds else 0.0}


def replay_trace(fio: str, trace_path, *, gap_s: float, passes: int, limit_bytes: int | None,
                 no_stall: bool = False, queue: str = "psync") -> dict:
    """Replay the last repeat of a trace file; adds s_per_token (the replay's time per token).

    queue "psync": io_threads psync jobs, the pieces dealt round-robin; "shared": one libaio job
    at iodepth io_threads, the pieces in the engine's order (its readers' one FIFO queue)."""
    head, records = read_trace(trace_path)
    records = one_repeat(records)
    if not records:
        raise ValueError(f"{trace_path}: the trace has no reads")
    mode = head.get("io_mode_effective") or head["io_mode"]
    qd = head["io_threads"]
    logs = job_iologs(records, jobs=1 if queue == "shared" else qd, io_threads=head["io_threads"],
                      chunk_size=head["chunk_size"], direct=mode == "direct", gap_s=0.0 if no_stall else gap_s,
                      passes=passes)
    out = replay(fio, logs, mode, limit_bytes, sorted({r["file"] for r in records}), no_stall=no_stall,
                 iodepth=qd if queue == "shared" else 1)
    expected, reads = iolog_bytes(logs), sum(text.count(" read ") for text in logs)
    if out["ios"] != reads or not expected - (qd - 1) * max_read(logs) <= out["bytes"] <= expected:
        raise RuntimeError(f"fio replayed {out['ios']} reads, {out['bytes']} bytes of the iologs' {reads}, {expected}")
    out["bytes"] = expected
    out.update(s_per_token=out["seconds"] / (passes * head["tokens"]), passes=passes, gap_s=gap_s,
               shape="no_stall" if no_stall else "paced", trace_bytes=sum(r["nbytes"] for r in records))
    return out


def max_read(iologs: list[str]) -> int:
    return max(int(line.split()[4]) for text in iologs for line in text.splitlines() if " read " in line)


def iolog_bytes(iologs: list[str]) -> int:
    """The bytes the read lines of the iologs ask for."""
    return sum(int(line.split()[4]) for text in iologs for line in text.splitlines() if " read " in line)


def outstanding_fraction(records: list[dict], window_s: float) -> float:
    """Share of the engine's decode window with at least one read submitted and not yet landed."""
    spans = sorted((max(r["submit_s"], 0.0), min(r["complete_s"], window_s)) for r in records)
    busy, end = 0.0, 0.0
    for lo, hi in spans:
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy / window_s if window_s > 0 else 0.0


# --- one row of benchmarks/streaming.py --trace-bound -------------------------------------------------


def measure_row(name: str, cfg, *, stream, fio: str, files, limit: int | None, request: int, fio_seconds: float,
                compute_s: float, passes: int, traces: dict, trace_dir) -> dict:
    """old fio, paced replay, stream (recording its trace), paced replay, old fio, no-stall replay.

    The paced replays sit right before and right after the streaming run: the before-job
    replays the trace of this config's previous run (the first run records one in a warm-up
    streaming run, not reported), the after-job the trace the streaming run just recorded.
    The old continuous fio jobs at the request size (fio_bound.py) go around them."""
    from benchmarks.fio_bound import fio_run
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


def main() -> int:
    import shutil
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a colibri bench --read-trace file")
    ap.add_argument("--passes", type=int, nargs="*", default=[1, 3], help="replay lengths, in passes of the trace")
    ap.add_argument("--repeats", type=int, default=2, help="jobs per length (lengths interleaved)")
    ap.add_argument("--gap-s", type=float, default=0.05, help="the paced shape's compute gap per token")
    ap.add_argument("--budget", default="1GiB", help="the cgroup limit of each fio job")
    ap.add_argument("--no-stall", action="store_true", help="replay back-to-back instead of paced")
    ap.add_argument("--queue", nargs="*", choices=("psync", "shared"), default=["psync"],
                    help="io_threads psync jobs, or one libaio job at iodepth io_threads")
    a = ap.parse_args()
    fio = shutil.which("fio")
    if fio is None:
        print("trace_bound: error: fio not found (apt-get install fio)", file=sys.stderr)
        return 2
    try:
        head, records = read_trace(a.trace)
    except (OSError, ValueError) as exc:
        print(f"trace_bound: error: {exc}", file=sys.stderr)
        return 2
    last = one_repeat(records)
    window = head["window_s"][-1]
    print(f"trace {a.trace}: {len(last)} reads, {sum(r['nbytes'] for r in last) / 2**20:.0f} MiB, "
          f"{head['tokens']} tokens in {window:.2f} s, reads outstanding {outstanding_fraction(last, window):.0%} "
          f"of it; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")
    print("\n| passes | queue | shape | replay s | GB/s | s/token |\n|---|---|---|---|---|---|")
    for _ in range(a.repeats):
        for passes in a.passes:
            for queue in a.queue:
                r = replay_trace(fio, a.trace, gap_s=a.gap_s, passes=passes, limit_bytes=parse_size(a.budget),
                                 no_stall=a.no_stall, queue=queue)
                print(f"| {passes} | {queue} | {r['shape']} | {r['seconds']:.2f} | {r['bytes'] / r['seconds'] / 1e9:.2f} "
                      f"| {r['s_per_token']:.4f} |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
