"""Ctrl-C and `kill` that cannot be lost while a long job runs.

Python delivers a signal by raising KeyboardInterrupt wherever the main thread happens to be. When
that is a weakref or `__del__` callback run by the garbage collector (SQLAlchemy's connection pool
has one), Python prints "Exception ignored in ..." and drops the exception: the Ctrl-C is lost and
`tune` goes on to its last trial. So the handler here also records the signal, and the long loops
call `raise_if_interrupted()` where they can stop cleanly (between trials, while a trial's process
runs), raising it again if the first one was swallowed.

Only the main thread may set handlers; `kept()` elsewhere is a no-op (then nothing is recorded).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_pending: str | None = None  # the message of the KeyboardInterrupt the last signal raised
_depth = 0  # nested kept() blocks; the record is cleared when the outermost one ends


def _interrupt() -> KeyboardInterrupt:
    """The pending signal's exception: Ctrl-C's bare, as Python's own handler raises it; `kill`'s
    naming its signal (tuner/search/outcome.py reports the signal from the message)."""
    return KeyboardInterrupt(_pending) if _pending else KeyboardInterrupt()


def _handler(signum, frame) -> None:
    global _pending
    _pending = "" if signum == signal.SIGINT else f"signal {signum}"
    raise _interrupt()


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (so `finally` blocks run on `kill` too) and are
    remembered until the outermost block ends. A signal the process was started ignoring stays ignored
    (a job a shell started in the background ignores Ctrl-C: so it still does)."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if _depth == 0:
            _pending = None


def interrupted() -> bool:
    """Whether a signal arrived inside the current `kept()` block."""
    return _pending is not None


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt of a signal that arrived, again: harmless when the first one is
    already unwinding (this is not reached), and the way out when something swallowed it."""
    if _pending is not None:
        raise _interrupt()
