"""Durable files and exclusive directories: what survives a crash, and what two processes share.

- `atomic_write_text`: UTF-8 whatever the locale, written to a temp file in the same directory,
  fsynced, renamed over the target, then the directory fsynced so the rename itself is on disk.
  A crash leaves the old file or the new one, never half of one.
- `DirectoryLock`: an exclusive lock on a directory that is being written (a model being
  synthesized or converted), held through a sibling lock file with `flock`. A second process
  waits — saying who it waits for — or, past `COLIBRI_LOCK_TIMEOUT` seconds, fails with one
  line. The kernel drops the lock when the holder dies, even by kill -9, so a crash never
  leaves a stale lock (only, then, an empty lock file that the next holder reuses and removes).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from engine.base.errors import BusyError

LOCK_TIMEOUT_ENV = "COLIBRI_LOCK_TIMEOUT"  # seconds; unset = wait as long as the holder lives
_POLL_S = 0.2  # only with a timeout: flock itself has none


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable (the file's own fsync does not cover it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:  # read it without the set-and-restore race of os.umask()
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make reports unreadable to others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text as UTF-8 (never the locale's encoding) via temp file + fsync + rename + dir fsync."""
    atomic_write_bytes(path, text.encode("utf-8"))


# --- directory lock ------------------------------------------------------------------------------

_held: dict[str, int] = {}  # lock path → depth: re-entrant within one process (flock is not)
_held_guard = threading.Lock()


def lock_path_for(target: str | os.PathLike) -> Path:
    target = Path(target).expanduser().absolute()
    return target.parent / f".{target.name}.lock"


def _env_timeout() -> float | None:
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BusyError(f"{LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return max(0.0, value)


class DirectoryLock:
    """`with DirectoryLock(model_dir, "synthesizing demo"):` — exclusive while the block runs.

    timeout: seconds to wait (None: $COLIBRI_LOCK_TIMEOUT, else without limit; 0: fail at once).
    on_wait(message) is called once if another process holds the lock (default: print to stderr).
    """

    def __init__(self, target: str | os.PathLike, purpose: str = "writing", timeout: float | None = None,
                 on_wait: Callable[[str], None] | None = None):
        self.target = Path(target).expanduser().absolute()
        self.path = lock_path_for(self.target)
        self.purpose = purpose
        self.timeout = timeout
        self.on_wait = on_wait if on_wait is not None else _print_wait
        self._fd: int | None = None

    def __enter__(self) -> "DirectoryLock":
        key = str(self.path)
        with _held_guard:
            if _held.get(key):
                _held[key] += 1
                return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                self._acquire(fd)
            except BaseException:
                os.close(fd)
                raise
            if self._still_linked(fd):
                break
            os.close(fd)  # the holder removed the file as we got it: lock the new one instead
        self._fd = fd
        os.ftruncate(fd, 0)  # who holds it, for the next process's message
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "purpose": self.purpose, "since": time.time()}).encode(), 0)
        with _held_guard:
            _held[key] = 1
        return self

    def _acquire(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        timeout = self.timeout if self.timeout is not None else _env_timeout()
        holder = self.holder(fd)
        if timeout is not None and timeout <= 0:
            raise BusyError(f"{self.target} is locked by {holder}; not waiting ({LOCK_TIMEOUT_ENV}=0)")
        self.on_wait(f"waiting for {holder} to finish with {self.target} ...")
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BusyError(f"{self.target} is still locked by {holder} after {timeout:g} s "
                                    f"({LOCK_TIMEOUT_ENV}); try again when it has finished") from None
                time.sleep(_POLL_S)

    def _still_linked(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)

    @staticmethod
    def holder(fd: int) -> str:
        """'pid 123 (synthesizing demo, for 12 s)' from the lock file, or 'another process'."""
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return f"pid {int(info['pid'])} ({info['purpose']}, for {time.time() - float(info['since']):.0f} s)"
        except (ValueError, KeyError, TypeError, OSError):
            return "another process"

    def __exit__(self, *exc) -> None:
        key = str(self.path)
        with _held_guard:
            _held[key] -= 1
            if _held[key]:
                return
            del _held[key]
        if self._fd is not None:
            # Unlink while still holding it: a waiter that then gets this inode sees it unlinked
            # and retries on a fresh file, so no two processes ever hold "the" lock at once.
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _print_wait(message: str) -> None:
    import sys
    print(message, file=sys.stderr, flush=True)
