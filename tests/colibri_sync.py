"""Waiting for an event another process emits: a file appearing, a trial row in a study.

Tests synchronise on what the code under test does, never on how long it usually takes. The
deadline is only a guard against a hang, far above any run on a loaded 2-core CI box; hitting
it is a failure with a message, not a shorter test. Imported by module name (pytest puts tests/
on sys.path, pyproject.toml).
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

GUARD_S = 600.0  # a hang, not a slow box: a loaded CI box takes minutes at most

T = TypeVar("T")


def wait_until(event: Callable[[], T], what: str, proc: subprocess.Popen | None = None,
               guard_s: float = GUARD_S) -> T:
    """Poll `event` until it returns something truthy and return that. A `proc` that exits
    first fails the wait at once with its output (the event can no longer happen)."""
    deadline = time.monotonic() + guard_s
    while True:
        found = event()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited with {proc.returncode} before {what}: {out!r} {err!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {guard_s:.0f} s")
        time.sleep(0.02)


def completed_trials(db: Path) -> int:
    """COMPLETE trials of the study in `db`, read without Optuna, which would create its tables
    (a second writer) while the tuner does."""
    try:
        # A short busy timeout: the caller polls again in 20 ms. Waiting up to 5 s on the tuner's
        # write lock let a fast tune finish trials past the one a test waits for (it then
        # interrupted a tune that had ended).
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.05)
    except sqlite3.Error:  # not created yet
        return 0
    try:
        return con.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.Error:  # no tables yet, or busy
        return 0
    finally:
        con.close()
