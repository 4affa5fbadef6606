"""Run a command inside a child memory cgroup and report the cgroup's peak memory.

Why a cgroup: a budget checked against RSS alone lets a buffered or mmap run hide gigabytes in
the page cache. A memory cgroup charges page cache to whoever faulted it in, so a limit on the
cgroup is an honest budget, and its peak is an honest figure to report next to peak RSS.

cgroup v1 (memory.limit_in_bytes, memory.max_usage_in_bytes, memory.oom_control) and v2
(memory.max, memory.peak, memory.events) are both supported. Children are made under this
process's own memory cgroup, named `colibri-<pid>-<n>`, and removed after the run.

The child joins the cgroup through a tiny exec shim (engine/_cgroup_exec.py) instead of
preexec_fn, which is not safe with threads. The shim's interpreter start-up (a few MB) is charged
to our cgroup, not the child's, and is discarded by exec before the command allocates anything.
"""

from __future__ import annotations

import errno
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from engine.errors import BudgetError

# Limits at or above this mean "no limit" (v1 writes PAGE_COUNTER_MAX * PAGE_SIZE, ~2**63).
_UNLIMITED = 1 << 60
_SHIM = Path(__file__).with_name("_cgroup_exec.py")
_counter = itertools.count()
_PROC_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"


@dataclass
class CgroupSupport:
    available: bool
    version: int | None
    path: str | None  # the parent directory where child cgroups are made
    reason: str


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


# --- discovery -------------------------------------------------------------------------------


def _read(path: Path) -> str:
    return path.read_text().strip()


def _own_cgroup_paths() -> dict[str, str]:
    """Map controller ("memory", or "" for the v2 unified hierarchy) to this process's path."""
    paths: dict[str, str] = {}
    try:
        lines = Path(_PROC_CGROUP).read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, mount root, fstype, super options) of every cgroup and cgroup2 mount."""
    mounts = []
    try:
        lines = Path(_MOUNTINFO).read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mount_point = fields[4].replace("\\040", " ")
        mounts.append((mount_point, fields[3], tail[0], set(tail[2].split(","))))
    return mounts


def _own_dir(mount_point: str, mount_root: str, own_path: str | None) -> Path:
    """This process's cgroup directory under a mount, allowing for containers whose mount shows
    only a subtree (mount root != "/") or whose cgroup namespace hides the real path."""
    base = Path(mount_point)
    if own_path:
        rel = own_path
        if mount_root not in ("", "/") and (own_path + "/").startswith(mount_root.rstrip("/") + "/"):
            rel = own_path[len(mount_root.rstrip("/")):]
        candidate = base / rel.lstrip("/")
        if candidate.is_dir():
            return candidate
    return base


def _version_of(directory: Path) -> int | None:
    if (directory / "cgroup.controllers").exists():
        return 2
    if (directory / "memory.limit_in_bytes").exists():
        return 1
    return None


def _find_hierarchy() -> tuple[int, Path, Path] | str:
    """(version, own cgroup dir, mount point) of the hierarchy holding the memory controller,
    or the reason there is none."""
    own = _own_cgroup_paths()
    mounts = _cgroup_mounts()
    # A controller lives in one hierarchy only; in hybrid setups v1 memory wins over cgroup2.
    for mount_point, root, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options:
            return 1, _own_dir(mount_point, root, own.get("memory")), Path(mount_point)
    for mount_point, root, fstype, _ in mounts:
        if fstype == "cgroup2":
            directory = _own_dir(mount_point, root, own.get(""))
            try:
                controllers = _read(directory / "cgroup.controllers").split()
            except OSError as err:
                return f"cannot read {directory}/cgroup.controllers: {err.strerror}"
            if "memory" in controllers:
                return 2, directory, Path(mount_point)
            return f"cgroup v2 at {mount_point} has no memory controller for this process ({directory})"
    if not mounts:
        return "no cgroup filesystem is mounted (or /proc/self/mountinfo is unreadable)"
    return "no cgroup hierarchy has the memory controller"


def _new_child(parent: Path) -> Path:
    for _ in range(100):
        child = parent / f"colibri-{os.getpid()}-{next(_counter)}"
        try:
            child.mkdir()
            return child
        except FileExistsError:  # left by an earlier process that had our pid
            continue
    raise FileExistsError(errno.EEXIST, "no free child cgroup name", str(parent))


def _check_parent(version: int, parent: Path) -> CgroupSupport:
    def no(reason: str) -> CgroupSupport:
        return CgroupSupport(False, version, str(parent), reason)

    if not parent.is_dir():
        return no(f"memory cgroup directory {parent} does not exist")
    if version == 2:
        try:
            subtree = _read(parent / "cgroup.subtree_control").split()
        except OSError as err:
            return no(f"cannot read {parent}/cgroup.subtree_control: {err.strerror}")
        if "memory" not in subtree:
            return no(
                f"cgroup v2: memory controller is not enabled for children of {parent} "
                "(add +memory to its cgroup.subtree_control, e.g. run under "
                "`systemd-run --scope -p Delegate=yes`)"
            )
        needed = ("memory.max", "memory.current")
    else:
        needed = ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
    if version == 1 and not (parent / needed[0]).exists():
        return no(f"{parent} is not a cgroup v1 memory directory (no {needed[0]})")
    if not os.access(parent, os.W_OK):
        return no(f"{parent} is not writable (needs root or a delegated cgroup; read-only mount?)")
    # The only sure test is to make a child: cgroupfs fills it with control files, a plain
    # directory (or a read-only or locked-down cgroupfs) does not.
    try:
        probe = _new_child(parent)
    except OSError as err:
        return no(f"cannot create a child cgroup in {parent}: {err.strerror or err}")
    try:
        missing = [name for name in needed if not (probe / name).exists()]
    finally:
        try:
            probe.rmdir()
        except OSError:
            _remove_plain_dir(probe)
    if missing:
        return no(f"{parent} is not a cgroup filesystem (a new child has no {missing[0]})")
    return CgroupSupport(True, version, str(parent), f"cgroup v{version} memory controller at {parent}")


def _remove_plain_dir(path: Path) -> None:
    """Undo a probe made in something that was not cgroupfs (no control files were created)."""
    try:
        for entry in path.iterdir():
            entry.unlink()
        path.rmdir()
    except OSError:
        pass


def detect_memory_cgroup(root: str | os.PathLike | None = None) -> CgroupSupport:
    """Can we make child memory cgroups? `root` overrides the memory hierarchy's mount point
    (the version is then read from the files there); this process's own cgroup under it is the
    parent, or `root` itself when that path does not exist there."""
    if root is None:
        found = _find_hierarchy()
        if isinstance(found, str):
            return CgroupSupport(False, None, None, found)
        version, parent, _ = found
        return _check_parent(version, parent)
    root = Path(root)
    if not root.is_dir():
        return CgroupSupport(False, None, str(root), f"{root} does not exist")
    version = _version_of(root)
    if version is None:
        return CgroupSupport(False, None, str(root), f"no memory controller files in {root}")
    own = _own_cgroup_paths().get("memory" if version == 1 else "")
    return _check_parent(version, _own_dir(str(root), "/", own))


def current_memory_limit() -> int | None:
    """Smallest memory limit set on this process's cgroup or its ancestors, in bytes; None when
    none is set or none is readable (the caller then falls back to physical RAM)."""
    found = _find_hierarchy()
    if isinstance(found, str):
        return None
    version, directory, mount_point = found
    name = "memory.limit_in_bytes" if version == 1 else "memory.max"
    limits = []
    while True:
        try:
            text = _read(directory / name)
        except OSError:
            text = ""
        if text.isdigit() and int(text) < _UNLIMITED:
            limits.append(int(text))
        if directory == mount_point or directory.parent == directory:
            break
        directory = directory.parent
    return min(limits) if limits else None


# --- running ---------------------------------------------------------------------------------


class _Cgroup:
    """One child cgroup for one run; knows its version's file names."""

    def __init__(self, version: int, path: Path):
        self.version, self.path = version, path

    @classmethod
    def create(cls, support: CgroupSupport, limit_bytes: int) -> "_Cgroup":
        cgroup = cls(support.version, _new_child(Path(support.path)))
        try:
            cgroup._set_limit(limit_bytes)
        except BaseException:
            cgroup.remove()
            raise
        return cgroup

    def _write(self, name: str, value: str) -> None:
        with open(self.path / name, "w") as f:
            f.write(value)

    def _set_limit(self, limit: int) -> None:
        if self.version == 1:
            # Memory first: memsw may never be below it. memsw == memory means swap cannot
            # stretch the budget; it is absent when the kernel does not account swap.
            self._write("memory.limit_in_bytes", str(limit))
            if (self.path / "memory.memsw.limit_in_bytes").exists():
                self._write("memory.memsw.limit_in_bytes", str(limit))
        else:
            self._write("memory.max", str(limit))
            if (self.path / "memory.swap.max").exists():
                self._write("memory.swap.max", "0")
            if (self.path / "memory.oom.group").exists():
                # One OOM kill takes the whole trial down instead of leaving it half-alive.
                self._write("memory.oom.group", "1")

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int(_read(self.path / name))
        except (OSError, ValueError):
            return None

    def current(self) -> int | None:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        try:
            return int(_read(self.path / name))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """OOM kills in this cgroup, or None when the kernel does not count them."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def hit_limit(self) -> bool:
        names = ("memory.failcnt", "memory.memsw.failcnt") if self.version == 1 else ()
        for name in names:
            try:
                if int(_read(self.path / name)) > 0:
                    return True
            except (OSError, ValueError):
                continue
        return False

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs_file.read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            try:
                self._write("cgroup.kill", "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, attempts: int = 50) -> None:
        """rmdir, killing leftovers (daemonized grandchildren) first; the kernel may need a few
        milliseconds after the last task exits before it lets the directory go."""
        for attempt in range(attempts):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    break
            self.kill_all()
            time.sleep(min(0.005 * (attempt + 1), 0.1))
        warnings.warn(f"could not remove cgroup {self.path}; remove it by hand", RuntimeWarning, stacklevel=3)


class _PeakSampler(threading.Thread):
    """Fallback for v2 kernels without memory.peak (< 5.19): poll memory.current. It can miss a
    short spike, which is why memory.peak is preferred whenever it exists."""

    def __init__(self, cgroup: _Cgroup, interval: float = 0.02):
        super().__init__(daemon=True)
        self.cgroup, self.interval = cgroup, interval
        self.peak: int | None = None
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            value = self.cgroup.current()
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value
            self._done.wait(self.interval)

    def stop(self) -> int | None:
        self._done.set()
        self.join()
        return self.peak


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
    proc: subprocess.Popen, timeout: float | None, cgroup: "_Cgroup | None" = None
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
    try:
        proc.wait(timeout)
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
        cgroup = _Cgroup.create(support, limit_bytes)
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
                sampler = _PeakSampler(cgroup)
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
