"""The child process of tests/colibri_fuzz.py: runs a batch of `colibri` command lines in-process,
under an address-space limit, and appends one JSON line per call to a results file.

Usage: python colibri_fuzz_runner.py SPEC.json   (SPEC: {"calls": [{"argv": [...], "cwd": ...}],
"as_bytes": N, "call_s": S, "restart_rss": N, "results": PATH}). Exit 3: stopped early after a
hang or with memory still held; the parent runs the remaining calls in a new process.

The limit is set before anything big is imported, so a reader that grows without bound gets a
MemoryError (recorded as that call's traceback) instead of eating the machine. A call still
running after call_s seconds is interrupted by SIGALRM (recorded as a hang; a blocking open() of a
FIFO is interrupted too). Results are flushed per call, so if the process dies the parent knows
which call killed it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import os
import resource
import signal
import sys
import time
import traceback


class CallTimeout(BaseException):  # BaseException: `except Exception` in the code under test must not eat it
    pass


def _on_alarm(signum, frame):
    raise CallTimeout()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Give freed heap back and restart the high-water mark, so each call's peak is its own
    (getrusage's ru_maxrss never goes down; writing 5 to clear_refs resets VmHWM, Linux >= 4.0)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def run_one(cli_main, argv: list[str], call_s: float) -> dict:
    out, err = io.StringIO(), io.StringIO()
    code, tb = None, ""
    _reset_peak_rss()
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, call_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(argv)
    except SystemExit as exc:  # argparse refusals (and its --help) exit
        code = exc.code if isinstance(exc.code, int) else 2
    except CallTimeout:
        code, tb = "hang", f"still running after {call_s} s"
    except BaseException:  # noqa: BLE001 - anything escaping main is the bug this suite looks for
        code, tb = "traceback", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    peak = _peak_rss()
    _reset_peak_rss()
    return {"code": code, "stdout": out.getvalue()[-2000:], "stderr": err.getvalue()[-4000:],
            "traceback": tb[-8000:], "seconds": round(time.monotonic() - t0, 3), "peak_rss": peak,
            "rss_after": _status_kib("VmRSS") * 1024}


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    resource.setrlimit(resource.RLIMIT_AS, (spec["as_bytes"], spec["as_bytes"]))
    signal.signal(signal.SIGALRM, _on_alarm)
    from tuner.cli import main as cli_main  # after the limit: what it maps counts against it

    start = os.getcwd()
    with open(spec["results"], "a", encoding="utf-8") as results:
        for i, call in enumerate(spec["calls"]):
            os.chdir(call.get("cwd") or start)
            record = {"i": i, **run_one(cli_main, call["argv"], spec["call_s"])}
            results.write(json.dumps(record) + "\n")
            results.flush()
            # A hang may leave a thread blocked (on a FIFO, ...) and a blow-up may leave memory
            # held: the parent starts a fresh process for the rest, so the next call is measured clean.
            if record["code"] == "hang" or record["rss_after"] > spec["restart_rss"]:
                return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
