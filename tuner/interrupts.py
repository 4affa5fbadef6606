"""Ctrl-C and SIGTERM stop a tune at safe points only.

Why: Python raises KeyboardInterrupt at whatever bytecode runs when the signal lands. In a tune
that is often inside Optuna's storage calls (`ask`, `tell`, `set_user_attr`: SQLAlchemy in the
middle of a commit). The trial was then left RUNNING, or the session was left broken so that
marking the trial FAIL failed too (silently), and the interrupt → kill -9 → resume test failed
in about one run in four (docs/BENCHMARKS.md has the 30-run figures before and after).

While `DeferredInterrupts` is active, SIGINT and SIGTERM only record that they came. They raise
KeyboardInterrupt inside `interruptible()` blocks — where the tuner waits for a trial's
subprocess or runs the probe, i.e. where nearly all the time goes, so Ctrl-C stays prompt — and
at `checkpoint()`. A second signal while one is pending raises at once: someone pressing Ctrl-C
twice wants out now (the trial is then left RUNNING, and a resume records it as FAIL).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupts:
    def __init__(self):
        self.pending: int | None = None
        self._open = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "DeferredInterrupts":
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handler(self, signum, frame) -> None:
        if self._open or self.pending is not None:
            self.pending = None
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.pending = signum

    def checkpoint(self) -> None:
        """Raise the interrupt that arrived since the last safe point, if any."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block a signal may cut short at once (no storage call in flight inside it)."""
        self.checkpoint()
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1


class _Never:
    """Stand-in when nothing defers interrupts (library use): every block is interruptible."""

    def checkpoint(self) -> None:
        pass

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        yield
