"""Signals during a tune raise only at safe points (tuner/interrupts.py)."""

import os
import signal

import pytest

from tuner.interrupts import DeferredInterrupts


def test_a_signal_outside_a_safe_point_waits_for_the_next_checkpoint():
    with DeferredInterrupts() as guard:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs now: it only records the signal
        recorded = guard.pending
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            guard.checkpoint()
    assert recorded == signal.SIGINT


def test_inside_an_interruptible_block_the_signal_raises_at_once():
    reached = []
    with DeferredInterrupts() as guard:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with guard.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("after")  # never: the handler raised
    assert reached == []


def test_a_pending_signal_raises_on_entering_an_interruptible_block():
    with DeferredInterrupts() as guard:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with guard.interruptible():
                pytest.fail("the block must not start with an interrupt pending")


def test_a_second_signal_while_one_is_pending_raises_at_once():
    with DeferredInterrupts():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with DeferredInterrupts():
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
