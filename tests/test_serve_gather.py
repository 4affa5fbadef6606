"""The idle server's gathering of simultaneous arrivals (colibri/serve/jobs.py, `serve --gather-ms`):
how long it waits, that a busy queue or a closed one never holds a job back, and the option's range."""

from __future__ import annotations

import threading

import pytest

from colibri.serve.jobs import GATHER_CAP, JobQueue, gather_left
from colibri.serve.server import MAX_GATHER_MS, ServeOptions, check_options
from engine.api import ConfigError


def test_it_waits_for_a_pause_in_arrivals_and_no_longer_than_the_cap():
    quiet = 0.005
    # One arrival at t=10: until 10.005; checked at 10.002, 3 ms are left.
    assert gather_left(10.0, 10.0, 10.002, quiet) == pytest.approx(0.003)
    assert gather_left(10.0, 10.0, 10.005, quiet) == 0.0
    # Each arrival restarts the pause: the second at 10.004 moves the start to 10.009.
    assert gather_left(10.0, 10.004, 10.006, quiet) == pytest.approx(0.003)
    # A steady trickle is cut at GATHER_CAP x quiet after the first arrival.
    cap_end = 10.0 + GATHER_CAP * quiet
    assert gather_left(10.0, cap_end - 0.001, cap_end - 0.002, quiet) == pytest.approx(0.002)
    assert gather_left(10.0, cap_end - 0.001, cap_end, quiet) == 0.0
    assert gather_left(10.0, 10.0, 10.0, 0.0) == 0.0  # off: start at once


def test_jobs_queued_long_ago_start_at_once_and_close_ends_a_gathering():
    q = JobQueue(4, gather_s=3600.0)  # a window no test could sit through
    q.put_nowait("a")
    q._first_at = q._last_at = q._last_at - 4 * 3600.0  # queued hours ago (a busy worker's backlog)
    assert q.wait(gather=True) is True and list(q.queue) == ["a"]

    q2 = JobQueue(4, gather_s=3600.0)
    waiting = threading.Thread(target=lambda: results.append(q2.wait(gather=True)))
    results: list[bool] = []
    q2.put_nowait("b")  # fresh: the waiter gathers, an hour at most
    waiting.start()
    q2.close()  # the server stops: the waiter ends now, with nothing left to start
    waiting.join(timeout=60)
    assert not waiting.is_alive() and results == [False]


def test_without_gather_a_queued_job_is_returned_at_once():
    q = JobQueue(4, gather_s=3600.0)
    q.put_nowait("a")
    assert q.wait() is True  # gather=False: the worker is busy or runs one at a time


def test_gather_ms_range_is_checked():
    assert check_options(ServeOptions(gather_ms=0)).gather_ms == 0
    assert check_options(ServeOptions(gather_ms=MAX_GATHER_MS)).gather_ms == MAX_GATHER_MS
    for bad in (-1, MAX_GATHER_MS + 1):
        with pytest.raises(ConfigError, match="--gather-ms must be in"):
            check_options(ServeOptions(gather_ms=bad))
