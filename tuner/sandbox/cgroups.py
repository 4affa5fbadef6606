"""Memory cgroups: find a usable hierarchy, make a limited child, read its peak and OOM count.

Why a cgroup: a budget checked against RSS alone lets a buffered or mmap run hide gigabytes in
the page cache. A memory cgroup charges page cache to whoever faulted it in, so a limit on the
cgroup is an honest budget, and its peak is an honest figure to report next to peak RSS.

cgroup v1 (memory.limit_in_bytes, memory.max_usage_in_bytes, memory.oom_control) and v2
(memory.max, memory.peak, memory.events) are both supported. Children are made under this
process's own memory cgroup, named `colibri-<pid>-<n>`, and removed after the run
(tuner/sandbox/limited.py runs commands in them).
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# Limits at or above this mean "no limit" (v1 writes PAGE_COUNTER_MAX * PAGE_SIZE, ~2**63).
_UNLIMITED = 1 << 60
# How long remove() waits for killed tasks to exit: a hang guard (they exit in milliseconds).
REMOVE_GUARD_S = 60.0
_counter = itertools.count()
_PROC_CGROUP = "/proc/self/cgroup"
_MOUNTINFO = "/proc/self/mountinfo"


@dataclass
class CgroupSupport:
    available: bool
    version: int | None
    path: str | None  # the parent directory where child cgroups are made
    reason: str


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


# --- one child cgroup -------------------------------------------------------------------------


class Cgroup:
    """One child cgroup for one run; knows its version's file names."""

    def __init__(self, version: int, path: Path):
        self.version, self.path = version, path

    @classmethod
    def create(cls, support: CgroupSupport, limit_bytes: int) -> "Cgroup":
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

    def _read_int(self, v1_name: str, v2_name: str) -> int | None:
        try:
            return int(_read(self.path / (v1_name if self.version == 1 else v2_name)))
        except (OSError, ValueError):
            return None

    def peak(self) -> int | None:
        return self._read_int("memory.max_usage_in_bytes", "memory.peak")

    def current(self) -> int | None:
        return self._read_int("memory.usage_in_bytes", "memory.current")

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

    def remove(self, guard_s: float = REMOVE_GUARD_S) -> None:
        """rmdir, killing leftovers (daemonized grandchildren) first. The kernel lets the
        directory go once the last killed task has run its exit, which on a loaded box can take
        a while: poll for that (no notification exists on v1), up to a guard against a hang."""
        deadline = time.monotonic() + guard_s
        attempt = 0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                    break
            self.kill_all()
            attempt += 1
            time.sleep(min(0.005 * attempt, 0.1))
        warnings.warn(f"could not remove cgroup {self.path}; remove it by hand", RuntimeWarning, stacklevel=3)


class PeakSampler(threading.Thread):
    """Fallback for v2 kernels without memory.peak (< 5.19): poll memory.current. It can miss a
    short spike, which is why memory.peak is preferred whenever it exists."""

    def __init__(self, cgroup: Cgroup, interval: float = 0.02):
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
