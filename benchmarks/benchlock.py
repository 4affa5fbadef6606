"""The shared benchmark lock: one flock file, so timed runs on a shared box never overlap."""

from __future__ import annotations

import contextlib
import fcntl


@contextlib.contextmanager
def bench_lock(path: str | None):
    """Hold the lock at `path` for one step (a build, a conversion, one measured run); None: no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
