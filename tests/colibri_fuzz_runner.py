"""The fork server of tests/colibri_fuzz.py: imports torch and the CLI once, then runs each
`colibri` command line in a forked grandchild, under an address-space limit and an alarm.

Usage: python colibri_fuzz_runner.py CONTROL_FD   (requests: one JSON line per call on stdin,
{"argv": [...], "cwd": ..., "env": {...}, "as_bytes": N, "call_s": S}; one JSON result line per
request on CONTROL_FD, in order). The server's own stdout/stderr go to the parent's log file.
A request may name another entry point than `colibri.cli.main` ("entry": "module:function", and
"grace_s"): tests/test_fuzz_harness.py checks with misbehaving ones that every way a call can
break the property is caught.

Why a fork per call: a child process per batch paid the torch + CLI import (seconds) once per
batch, and a hang or a blow-up poisoned the rest of its batch. A fork starts from the imported
state in milliseconds, and whatever a call does to its process (memory it keeps, a thread blocked
on a FIFO, a changed cwd or environment, a signal handler) dies with it. The server never runs a
torch operation itself, so no thread pool exists at fork time.

In the grandchild: the address-space limit is set first, so a reader that grows without bound
gets a MemoryError (recorded as that call's traceback) instead of eating the machine; SIGALRM
after call_s seconds interrupts a call still running (recorded as a hang, with where it was, and
a blocking open() of a FIFO is interrupted too); the peak RSS is the grandchild's own high-water
mark, restarted at the fork. If the grandchild dies without reporting (killed, a crash in native
code) or outlives call_s by a grace period, the server says so ("died" / "hang") and kills its
process group.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

GRACE_S = 20  # past call_s: the alarm did not stop the call (blocked in native code); kill it

# What the commands import on first use (function-level imports in colibri/commands/*): imported
# once here so that no grandchild pays for them. Only imports: no torch operation runs here.
WARM_MODULES = [
    "colibri.cli", "torch", "optuna", "tokenizers", "safetensors",
    "engine.run.oneshot", "engine.run.generate", "engine.run.bench", "engine.run.quality", "engine.run.resolve",
    "engine.run.prompts_file", "engine.format.convert", "engine.synth", "tuner.results.report_html",
    "tuner.results.printers", "tuner.share.compare", "tuner.share.profiles", "tuner.search.study",
    "tuner.search.quant_tune", "tuner.search.trial", "tuner.costmodel.plan_command", "tuner.probe",
]


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


def _restart_peak_rss() -> None:
    """Restart the high-water mark at the current RSS (getrusage's ru_maxrss never goes down, and
    a fork inherits it; writing 5 to clear_refs resets VmHWM, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_in_grandchild(cli_main, req: dict) -> dict:
    """The call itself (in the forked grandchild): its result record."""
    if req.get("entry"):
        module, name = req["entry"].split(":")
        cli_main = getattr(importlib.import_module(module), name)
    resource.setrlimit(resource.RLIMIT_AS, (req["as_bytes"], req["as_bytes"]))
    os.chdir(req.get("cwd") or os.getcwd())
    os.environ.update(req.get("env") or {})
    out, err = io.StringIO(), io.StringIO()
    code, tb = None, ""
    call_s = req["call_s"]
    _restart_peak_rss()
    t0 = time.monotonic()
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, call_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(req["argv"])
    except SystemExit as exc:  # argparse refusals (and its --help) exit
        code = exc.code if isinstance(exc.code, int) else 2
    except CallTimeout:
        code, tb = "hang", f"still running after {call_s} s:\n" + traceback.format_exc()
    except BaseException:  # noqa: BLE001 - anything escaping main is the bug this suite looks for
        code, tb = "traceback", traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"code": code, "stdout": out.getvalue()[-2000:], "stderr": err.getvalue()[-4000:],
            "traceback": tb[-8000:], "seconds": round(time.monotonic() - t0, 3),
            "peak_rss": _status_kib("VmHWM") * 1024}


def serve_one(cli_main, req: dict, control_fd: int) -> dict:
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the grandchild: never returns into the server's loop
        status = 0
        try:
            os.close(r)
            os.close(control_fd)
            os.setpgid(0, 0)  # its own group: a hang's helpers die with it
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            record = run_in_grandchild(cli_main, req)
            data = json.dumps(record).encode()
            while data:
                data = data[os.write(w, data):]
        except BaseException:  # noqa: BLE001 - the record could not be made: the server reports "died"
            traceback.print_exc()
            status = 1
        finally:
            os._exit(status)
    os.close(w)
    grace = req.get("grace_s", GRACE_S)
    deadline = t0 + req["call_s"] + grace
    chunks, killed = [], False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            killed = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # anything the call left running in its group
    _, status = os.waitpid(pid, 0)
    seconds = round(time.monotonic() - t0, 3)
    if killed:
        return {"code": "hang", "stderr": "", "stdout": "", "peak_rss": 0, "seconds": seconds,
                "traceback": f"still running {grace} s after its alarm ({req['call_s']} s): killed"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
        return {"code": "died", "stderr": "", "stdout": "", "peak_rss": 0, "seconds": seconds,
                "traceback": f"the call's process ended ({how}) without reporting (see the runner log)"}


def main(control_fd: int) -> int:
    for name in WARM_MODULES:
        importlib.import_module(name)
    cli = sys.modules["colibri.cli"]
    for name in sorted(set(cli.COMMANDS.values())):  # the CLI imports a command's module on first use only
        importlib.import_module(name)
    cli_main = cli.main
    with os.fdopen(control_fd, "w", encoding="utf-8") as control:
        control.write(json.dumps({"ready": True}) + "\n")
        control.flush()
        for line in sys.stdin:
            record = serve_one(cli_main, json.loads(line), control_fd)
            control.write(json.dumps(record) + "\n")
            control.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
