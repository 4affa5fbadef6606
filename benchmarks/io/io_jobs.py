"""The I/O jobs behind benchmarks/io/io_bound.py: fio at the engine's read pattern, fio replays of
the engine's own read trace, and the same trace replayed through the engine's reader.

- `fio_run`: one continuous fio job at the engine's pattern (request, QD, mode): request = the
  size of one read the engine issues for an expert span (`request_bytes`: the whole span, split
  into min(io_threads, span / chunk_size) pieces only past chunk_size; a tree from before
  one-read-per-span: chunk sized pieces), QD = io_threads synchronous readers (fio psync jobs,
  one in flight each), mode = O_DIRECT, buffered or mmap. Each job runs inside a memory cgroup
  limited to the engine's budget, so buffered and mmap reads cannot be served from a page cache
  larger than the engine itself could hold; the model's pages are dropped before every job.
- `replay_trace`: a `colibri bench --read-trace` file (engine/movement/io/trace.py) turned into
  one fio v3 iolog per reader (`job_iologs`): each read split exactly as the pool splits a span
  and the pieces dealt round-robin, in submit order, to io_threads psync jobs, O_DIRECT or
  buffered as the config, inside the budget's cgroup, the pages dropped first. Paced (an idle
  gap of the resident compute per token before each token's reads: the bound) or no-stall (as
  fast as the QD allows).
- `pool_replay`: the same trace, same pieces, same QD and pacing through engine/movement/io's
  ReadPool and SlotArena instead of fio: if it reads faster than fio's replay, the difference is
  the I/O path, not the load shape.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from pathlib import Path

from engine.api import align_down, align_up
from engine.api.lab import ReadPool, SlotArena, read_trace
from tuner.sandbox import run_limited

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


# --- fio replays of a read trace ---------------------------------------------------------------

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


# --- the same trace through the engine's reader -----------------------------------------------------

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
