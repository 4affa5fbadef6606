"""A Ctrl-C that something swallowed is raised again where the long loops can stop (tuner/base/interrupts.py).

Python drops a KeyboardInterrupt raised inside a garbage-collector callback ("Exception ignored in"):
the tests swallow one the same way, with `except KeyboardInterrupt: pass` around the signal."""

import signal
import sys
import time

import psutil
import pytest

from tuner.base import interrupts
from tuner.sandbox import detect_memory_cgroup, run_limited

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _swallowed(sig: int) -> None:
    # raise_signal runs the Python handler before it returns: the KeyboardInterrupt is raised here.
    try:
        signal.raise_signal(sig)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError(f"signal {sig} raised nothing")


def test_a_swallowed_ctrl_c_is_raised_again_until_the_block_ends():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.kept():
        interrupts.raise_if_interrupted()  # nothing arrived: nothing raised
        _swallowed(signal.SIGINT)
        assert interrupts.interrupted()
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()
        with pytest.raises(KeyboardInterrupt):  # every check point raises it, not only the first
            interrupts.raise_if_interrupted()
    assert not interrupts.interrupted()
    interrupts.raise_if_interrupted()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_kill_raises_a_keyboard_interrupt_that_names_the_signal():
    with interrupts.kept():
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
            interrupts.raise_if_interrupted()


def test_an_inner_block_ending_keeps_the_outer_blocks_record():
    with interrupts.kept():
        with interrupts.kept():
            _swallowed(signal.SIGINT)
        assert interrupts.interrupted()  # e.g. a probe inside a tune: the tune must still stop
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()
    assert not interrupts.interrupted()


def test_a_signal_the_process_ignores_stays_ignored():
    """A job a shell started in the background ignores Ctrl-C; kept() must not make it answer one."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.kept():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # ignored: nothing raised, nothing recorded
            assert not interrupts.interrupted()
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # SIGTERM still kept
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("limited", [False, True], ids=["plain", "cgroup"])
def test_a_running_command_is_ended_by_a_swallowed_ctrl_c(limited):
    if limited and not detect_memory_cgroup().available:
        pytest.skip("no writable memory cgroup here")
    others = {c.pid for c in psutil.Process().children(recursive=True)}  # (other tests' servers, workers)
    with interrupts.kept():
        _swallowed(signal.SIGINT)
        start = time.monotonic()
        # Without the check in the wait the run would end only at its timeout, and return.
        with pytest.raises(KeyboardInterrupt):
            run_limited(SLEEPER, 128 << 20 if limited else None, timeout=60)
        assert time.monotonic() - start < 30
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in others]
    assert not left  # the command was killed, not left running
