"""Storage jobs through fio: one subprocess per job (argv list, JSON output), parsed here.

One fio run per job costs ~0.3 s of start-up here but gives per-job progress, and a job that
fails names itself; grouping jobs with `stonewall` saved only ~0.06 s per job when measured.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tuner.probe.probe_errors import ProbeError
from tuner.probe.hardware_profile import StoragePoint
from tuner.probe.storage import StorageJob, make_point

ENGINE_PREFERENCE = ("io_uring", "libaio", "psync")
FIO_ENV = "COLIBRI_FIO"
# Beyond the job's runtime: start-up, file open and cache invalidation on a slow disk.
_GRACE_S = 60.0


def find_fio(fio_path: str | os.PathLike | None = None) -> str | None:
    """fio to use: the explicit path, else $COLIBRI_FIO, else `fio` on PATH; None if absent."""
    candidate = fio_path or os.environ.get(FIO_ENV)
    if candidate:
        found = shutil.which(str(candidate))
        return found if found else None
    return shutil.which("fio")


def fio_version(fio: str) -> str:
    out, err, rc = _run([fio, "--version"], timeout=30)
    version = out.strip().splitlines()[0] if out.strip() else ""
    if rc != 0 or not version:
        raise ProbeError(f"fio failed: {_message(out, err, rc)}")
    return version


def job_argv(fio: str, job: StorageJob, path: Path, file_bytes: int, runtime_s: float,
             ioengine: str) -> list[str]:
    # fio splits --filename on ':'; a directory name may hold one.
    filename = str(path).replace(":", "\\:")
    argv = [
        fio, "--output-format=json", "--name=colibri-probe", f"--filename={filename}",
        f"--size={file_bytes}", f"--rw={job.pattern}", f"--bs={job.request_bytes}",
        f"--direct={int(job.direct)}", f"--ioengine={ioengine}",
        # Never write to or create anything: the file is ours and already full.
        "--readonly", "--allow_file_create=0",
        "--invalidate=1", "--lat_percentiles=1", "--percentile_list=50:99",
        f"--runtime={max(1, round(runtime_s * 1000))}ms",
    ]
    if job.time_based:
        argv.append("--time_based")
    if ioengine in ("psync", "sync", "pvsync"):
        # A synchronous engine has one request in flight per job: depth comes from jobs.
        argv += ["--iodepth=1", f"--numjobs={job.queue_depth}", "--group_reporting",
                 "--thread"]
    else:
        argv.append(f"--iodepth={job.queue_depth}")
    return argv


def run_job(fio: str, job: StorageJob, path: Path, file_bytes: int, runtime_s: float,
            ioengine: str) -> StoragePoint:
    argv = job_argv(fio, job, path, file_bytes, runtime_s, ioengine)
    out, err, rc = _run(argv, timeout=runtime_s + _GRACE_S)
    if rc != 0:
        raise ProbeError(f"fio failed on {job.label}: {_message(out, err, rc)}")
    return point_from_result(parse_fio_output(out), job)


def run_first_job(fio: str, job: StorageJob, path: Path, file_bytes: int, runtime_s: float,
                  engines: tuple[str, ...] = ENGINE_PREFERENCE) -> tuple[StoragePoint, str]:
    """Run the first job with the first engine of `engines` that works; (point, engine).

    io_uring is often blocked in containers (seccomp) and libaio is Linux-only; psync always
    exists, so when it fails too the problem is not the engine, and its message is reported.
    Trying engines on the first real job saves a separate check run (~0.4 s).
    """
    message = ""
    for engine in engines:
        argv = job_argv(fio, job, path, file_bytes, runtime_s, engine)
        out, err, rc = _run(argv, timeout=runtime_s + _GRACE_S)
        if rc == 0:
            try:
                return point_from_result(parse_fio_output(out), job), engine
            except ProbeError as exc:
                message = str(exc)
        else:
            message = _message(out, err, rc)
    raise ProbeError(f"fio failed on {job.label}: {message}")


def parse_fio_output(text: str) -> dict[str, Any]:
    """fio's JSON document; fio may print notes before it, so parsing starts at the first '{'."""
    start = text.find("{")
    if start < 0:
        raise ProbeError("fio printed no JSON output")
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise ProbeError(f"fio printed malformed JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list) or not doc["jobs"]:
        raise ProbeError("fio's JSON output has no jobs")
    return doc


def point_from_result(doc: dict[str, Any], job: StorageJob) -> StoragePoint:
    """The StoragePoint of a one-job (or group-reported) fio result."""
    result = doc["jobs"][0]
    if result.get("error"):
        raise ProbeError(f"fio job {job.label} failed with error {result['error']} "
                         f"({os.strerror(result['error'])})")
    try:
        read = result["read"]
        lat = read["lat_ns"] if "percentile" in read.get("lat_ns", {}) else read["clat_ns"]
        pct = lat["percentile"]
        return make_point(
            job,
            runtime_s=read["runtime"] / 1000.0,
            bandwidth_bps=float(read["bw_bytes"]),
            iops=float(read["iops"]),
            lat_mean_us=read["lat_ns"]["mean"] / 1000.0,
            lat_p50_us=_percentile(pct, 50.0) / 1000.0,
            lat_p99_us=_percentile(pct, 99.0) / 1000.0,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProbeError(f"fio's JSON output lacks an expected field ({exc})") from None


def _percentile(percentiles: dict[str, float], p: float) -> float:
    for key, value in percentiles.items():
        if abs(float(key) - p) < 1e-9:
            return float(value)
    raise KeyError(f"percentile {p}")


def _run(argv: list[str], timeout: float) -> tuple[str, str, int]:
    """Run fio; an interrupt or timeout kills it before the caller removes the test file."""
    proc = None
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True)
        out, err = proc.communicate(timeout=timeout)
    except OSError as exc:
        raise ProbeError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ProbeError(f"fio did not finish within {timeout:.0f} s") from None
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
        raise
    return out, err, proc.returncode


def _message(out: str, err: str, rc: int) -> str:
    """fio's own words, on one line: its stderr, else the error lines of its stdout."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    if not lines:
        lines = [ln.strip() for ln in out.splitlines()
                 if ln.strip().startswith(("fio:", "error", "Error"))]
    text = "; ".join(dict.fromkeys(lines))  # fio repeats a message once per job
    if len(text) > 400:
        text = text[:400] + " ..."
    return text or f"exit status {rc} and no message"
