"""Run a command inside a child memory cgroup and report the cgroup's peak memory.

The child joins the cgroup through a tiny exec shim (tuner/sandbox/_exec.py) instead of
preexec_fn, which is not safe with threads. The shim's interpreter start-up (a few MB) is charged
to our cgroup, not the child's, and is discarded by exec before the command allocates anything.
Where no cgroup can be made the command runs plainly and the result says why.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.api import BudgetError
from tuner.base import interrupts
from tuner.sandbox.cgroups import Cgroup, PeakSampler, detect_memory_cgroup

_SHIM = Path(__file__).with_name("_exec.py")
_WAIT_SLICE_S = 0.25  # how late a swallowed Ctrl-C may end a run


@dataclass
class LimitedRun:
    returncode: int  # negative: killed by that signal (subprocess convention)
    stdout: str
    stderr: str
    wall_seconds: float
    timed_out: bool
    oom_killed: bool  # the kernel OOM-killed a process of the run (not always the main one)
    limited: bool  # really ran inside a cgroup limited to limit_bytes
    limit_bytes: int | None
    peak_bytes: int | None  # cgroup peak, page cache included; None when not limited
    reason: str  # why the run was not limited; "" when it was


def _wait_for_exec(status_r: int, proc: subprocess.Popen) -> str | None:
    """Block until the shim has exec'd (EOF on the status pipe). Returns the shim's failure line
    ("join:..." or "exec:...") or None on success."""
    chunks = []
    while True:
        ready, _, _ = select.select([status_r], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        data = os.read(status_r, 4096)
        if not data:
            break
        chunks.append(data)
    line = b"".join(chunks).decode("utf-8", "replace").strip()
    return line or None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _PipeReader(threading.Thread):
    """Drains one pipe with os.read, so whatever arrived is kept even if we stop waiting."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.chunks = stream, []

    def run(self) -> None:
        fd = self.stream.fileno()
        try:
            while chunk := os.read(fd, 1 << 16):
                self.chunks.append(chunk)
        except OSError:
            pass
        finally:
            self.stream.close()

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


# How long processes left behind by an exited command may keep its pipes open before they are
# killed: the command is the unit of work, its leftovers must not hold the caller hostage.
_LEFTOVER_GRACE_S = 0.5


def _join_all(readers: list[_PipeReader], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    return not any(reader.is_alive() for reader in readers)


def _collect(
    proc: subprocess.Popen, timeout: float | None, cgroup: "Cgroup | None" = None
) -> tuple[str, str, bool, float]:
    """Wait for the command (killing it at the timeout) and read its output. Returns stdout,
    stderr, whether it timed out, and the monotonic time at which it ended."""
    readers = [_PipeReader(proc.stdout), _PipeReader(proc.stderr)]
    for reader in readers:
        reader.start()

    def kill_everything() -> None:
        _kill_group(proc)
        if cgroup is not None:
            cgroup.kill_all()

    timed_out = False
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            # In slices: a Ctrl-C that something swallowed still ends the run (the caller's
            # `finally` kills the command). tuner/base/interrupts.py says how one gets lost.
            interrupts.raise_if_interrupted()
            left = None if deadline is None else deadline - time.monotonic()
            try:
                proc.wait(_WAIT_SLICE_S if left is None else max(0.0, min(left, _WAIT_SLICE_S)))
                break
            except subprocess.TimeoutExpired:
                if left is not None and left <= _WAIT_SLICE_S:
                    raise
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_everything()
        proc.wait()
    ended = time.monotonic()
    if not _join_all(readers, _LEFTOVER_GRACE_S):
        kill_everything()
        # Without a cgroup a daemon that left our process group cannot be found; give up on
        # the rest of its output rather than wait for it.
        _join_all(readers, _LEFTOVER_GRACE_S)
    return readers[0].text(), readers[1].text(), timed_out, ended


def _popen(argv: list[str], env, cwd, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group, so a timeout kills grandchildren too
        pass_fds=pass_fds,
    )


def _run_unlimited(argv, limit_bytes, timeout, env, cwd, reason) -> LimitedRun:
    start = time.monotonic()
    proc = _popen(argv, env, cwd)
    try:
        out, err, timed_out, ended = _collect(proc, timeout)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    return LimitedRun(
        returncode=proc.returncode, stdout=out, stderr=err, wall_seconds=ended - start,
        timed_out=timed_out, oom_killed=False, limited=False, limit_bytes=limit_bytes,
        peak_bytes=None, reason=reason,
    )


def run_limited(
    argv: list[str],
    limit_bytes: int | None,
    *,
    timeout: float | None = None,
    env: dict | None = None,
    cwd=None,
    require: bool = False,
) -> LimitedRun:
    """Run argv with its memory, page cache included, capped at limit_bytes by a fresh child
    cgroup, and report the cgroup's peak. Without a limit, or where cgroups are unusable, the
    command runs plainly (limited=False, reason says why) unless `require` is set, which raises
    BudgetError instead. A timeout kills the command's whole process group."""
    argv = [os.fspath(a) for a in argv]
    if not argv:
        raise ValueError("run_limited needs a command")
    if limit_bytes is not None and limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    if limit_bytes is None:
        reason = "no memory limit requested"
    else:
        support = detect_memory_cgroup()
        reason = "" if support.available else support.reason
    if reason:
        if require:
            raise BudgetError(f"cannot enforce a memory limit: {reason}")
        return _run_unlimited(argv, limit_bytes, timeout, env, cwd, reason)

    try:
        cgroup = Cgroup.create(support, limit_bytes)
    except OSError as err:
        reason = f"cannot create a limited child cgroup in {support.path}: {err.strerror or err}"
        if require:
            raise BudgetError(f"cannot enforce a memory limit: {reason}") from err
        return _run_unlimited(argv, limit_bytes, timeout, env, cwd, reason)

    sampler = None
    proc = None
    start = time.monotonic()
    try:
        status_r, status_w = os.pipe()
        try:
            shim = [sys.executable, "-I", "-S", str(_SHIM), str(cgroup.procs_file), str(status_w), "--"]
            proc = _popen(shim + argv, env, cwd, pass_fds=(status_w,))
            os.close(status_w)
            status_w = -1
            if cgroup.version == 2 and not (cgroup.path / "memory.peak").exists():
                sampler = PeakSampler(cgroup)
                sampler.start()
            failure = _wait_for_exec(status_r, proc)
        finally:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
        if failure is not None:
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
            stage, _, rest = failure.partition(":")
            code, _, message = rest.partition(":")
            if stage == "exec":
                raise OSError(int(code or 0), message, argv[0])
            reason = f"could not join cgroup {cgroup.path}: {message}"
            if require:
                raise BudgetError(f"cannot enforce a memory limit: {reason}")
            cgroup.remove()
            return _run_unlimited(argv, limit_bytes, timeout, env, cwd, reason)

        remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        out, err, timed_out, ended = _collect(proc, remaining, cgroup)
        wall = ended - start
        polled = sampler.stop() if sampler is not None else None
        sampler = None
        peak = cgroup.peak() if polled is None else polled
        kills = cgroup.oom_kills()
        if kills is None:  # old kernels: infer from the limit being hit plus a SIGKILL death
            oom = not timed_out and proc.returncode == -signal.SIGKILL and cgroup.hit_limit()
        else:
            oom = kills > 0
        return LimitedRun(
            returncode=proc.returncode, stdout=out, stderr=err, wall_seconds=wall,
            timed_out=timed_out, oom_killed=oom, limited=True, limit_bytes=limit_bytes,
            peak_bytes=peak, reason="",
        )
    finally:
        # Also runs on KeyboardInterrupt: nothing of the run may outlive it, cgroup included.
        if sampler is not None:
            sampler.stop()
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        cgroup.kill_all()
        cgroup.remove()


class LimitedProcess:
    """A long-lived command in its own memory cgroup at `limit_bytes`, spoken to one line at a time
    (`ask`: a line to its stdin, its next stdout line back), where run_limited runs a command to its
    end. For measurements that take turns between several limited processes, seconds apart, so the
    box's drifts cancel in their pairs (benchmarks/time/draft_decode.py --paired under a budget).
    Without cgroups the command runs plainly (`limited` False, `reason` says why). Its stderr is
    drained as it comes (kept for the error of a failed `ask`). `close` ends it, cgroup included."""

    def __init__(self, argv: list[str], limit_bytes: int, *, cwd=None, env: dict | None = None):
        argv = [os.fspath(a) for a in argv]
        self.limit_bytes, self.cgroup, self.reason = limit_bytes, None, ""
        support = detect_memory_cgroup()
        if support.available:
            try:
                self.cgroup = Cgroup.create(support, limit_bytes)
            except OSError as err:
                self.reason = f"cannot create a limited child cgroup in {support.path}: {err.strerror or err}"
        else:
            self.reason = support.reason
        status_r = status_w = -1
        try:
            if self.cgroup is not None:
                status_r, status_w = os.pipe()
                argv = [sys.executable, "-I", "-S", str(_SHIM), str(self.cgroup.procs_file), str(status_w), "--"] + argv
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env=env, cwd=cwd, start_new_session=True, text=True,
                                         pass_fds=(status_w,) if status_w >= 0 else ())
            if status_w >= 0:
                os.close(status_w)
                status_w = -1
                failure = _wait_for_exec(status_r, self.proc)
                if failure is not None:
                    raise OSError(f"{argv[-1]}: could not start in cgroup {self.cgroup.path}: {failure}")
        except BaseException:
            self.close()
            raise
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
        self._stderr = _PipeReader(self.proc.stderr)
        self._stderr.start()

    @property
    def limited(self) -> bool:
        return self.cgroup is not None

    def ask(self, line: str, timeout: float | None = None) -> str:
        """Send one line, return the command's next stdout line. A command that ends first (or does not
        answer within `timeout`) raises RuntimeError with the end of its stderr."""
        try:
            self.proc.stdin.write(line.rstrip("\n") + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it ended: the read below says why
        return self.answer(timeout)

    def answer(self, timeout: float | None = None) -> str:
        """The command's next stdout line (one it prints unasked: that it is ready); RuntimeError as
        for `ask`."""
        # A watchdog, not select: a text stream may hold a read-ahead line select cannot see
        watchdog = threading.Timer(timeout, _kill_group, (self.proc,)) if timeout else None
        if watchdog is not None:
            watchdog.start()
        try:
            answer = self.proc.stdout.readline()
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if not answer:
            self.close()
            raise RuntimeError(f"it ended (exit {self.proc.returncode}) before answering: "
                               f"{self._stderr.text().strip()[-600:]}")
        return answer

    def peak(self) -> int | None:
        return self.cgroup.peak() if self.cgroup is not None else None

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()  # EOF: its loop ends by itself ...
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                _kill_group(proc)  # ... or it is ended
                proc.wait()
        if proc is not None:
            proc.stdout.close()  # (its stderr: the reader closes it)
        if self.cgroup is not None:
            self.cgroup.kill_all()
            self.cgroup.remove()
            self.cgroup = None

    def __enter__(self) -> "LimitedProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
