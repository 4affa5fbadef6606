"""The server's requests as the generation worker takes them: a Job (one request: its prompt, sampling,
and where its tokens go), its JobResult, and the bounded FIFO JobQueue they wait in.

The queue gathers simultaneous arrivals (`serve --gather-ms`). When the worker is idle, the first
request would otherwise start its prefill alone and the ones a few milliseconds behind it (several
clients released together, an agent's parallel calls, a burst) would wait that whole prefill before
joining: under a streaming budget each prefill pass reads nearly every routed expert, so three of
four simultaneous prompts waited a whole pass for the first, then read the experts again. Waiting until the arrivals pause (`gather_s`
without a new one, at most GATHER_CAP times that from the first) lets the scheduler prefill them in
one pass (engine/run/batch.py). A lone request pays the pause once (20 ms by default, against a
prefill of a second or more); a busy worker never waits here (newcomers join at its step boundaries).
Measured on demo under 1 GiB, cold, four clients released together at a fresh server: 5 ms let the
first start alone in 3 of 3 rounds (its spread of arrivals is longer), 20 ms gathered all four in 3 of
3 (docs/BENCHMARKS.md, issue 39).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from engine.api import Generation
from colibri.serve.protocol import Sampling

# The longest an idle worker gathers, as a multiple of the quiet time that ends a gathering: a
# steady trickle of arrivals must not hold the first one back for long.
GATHER_CAP = 4


def gather_left(first_at: float, last_at: float, now: float, gather_s: float) -> float:
    """Seconds an idle worker still waits before it starts the queued requests: until `gather_s`
    have passed without an arrival (the last came at `last_at`), and never past GATHER_CAP x
    gather_s after the first of them came (`first_at`). 0: start now."""
    if gather_s <= 0:
        return 0.0
    return max(0.0, min(last_at + gather_s, first_at + GATHER_CAP * gather_s) - now)


@dataclass(eq=False)  # each job is itself (the worker keeps the running ones in a set)
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    # emit(kind, value), called on the worker thread: ("text", str) and, when log-probs were
    # asked, ("logprob", TokenLogprob) before the text its token gave; then ("done", JobResult).
    # With sampling.n > 1 each value is (choice index, value), and each choice ends with its "done".
    emit: object
    cancelled: threading.Event = field(default_factory=threading.Event)
    seq: int = 0
    # Keep special tokens in the text: tool-call markers are special tokens in some vocabularies
    # (gpt-oss's harmony channels, GLM's <tool_call>), and a parser cannot find what decode drops.
    special_text: bool = False
    # engine LogitsProcessors for this job only (n = 1), after the sampler's penalties (and a
    # response_format's grammar, which the worker adds); one whose done() ends the generation
    # ends it with finish_reason "stop"
    processors: list = field(default_factory=list)
    submitted_at: float = 0.0  # time.perf_counter() when queued (its wait is counted from here)
    choices: list = field(default_factory=list, repr=False)  # its running sequences (the worker's _Choice)

    @property
    def n(self) -> int:
        return getattr(self.sampling, "n", 1)


@dataclass
class JobResult:
    text: str
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    generation: Generation | None
    error: str | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused, not computed (OpenAI usage.prompt_tokens_details)."""
        return self.generation.cached_tokens if self.generation is not None else 0


class JobQueue:
    """The bounded FIFO of jobs not started yet. `queue` is the deque itself (read, never changed,
    by other threads); the head is looked at before it is taken, since it starts only when the
    scheduler has a cache for each of its n sequences."""

    def __init__(self, maxsize: int, gather_s: float = 0.0):
        self.maxsize = maxsize
        self.gather_s = gather_s
        self.queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self.closed = False
        # When the queue last went from empty to not, and when the latest job came (time.monotonic).
        self._first_at = self._last_at = 0.0

    def put_nowait(self, job: Job) -> None:
        with self._cond:
            if len(self.queue) >= self.maxsize:
                raise queue.Full
            now = time.monotonic()
            if not self.queue:
                self._first_at = now
            self._last_at = now
            self.queue.append(job)
            self._cond.notify()

    def wait(self, gather: bool = False) -> bool:
        """Block until a job is queued (True) or the queue is closed and empty (False). gather: then
        also until the arrivals pause (gather_left), so jobs that come together start together."""
        with self._cond:
            while not self.queue and not self.closed:
                self._cond.wait()
            while gather and self.queue and not self.closed:
                left = gather_left(self._first_at, self._last_at, time.monotonic(), self.gather_s)
                if left <= 0:
                    break
                self._cond.wait(left)  # a new arrival wakes it to count its pause again
            return bool(self.queue)

    def head(self) -> Job | None:
        with self._cond:
            return self.queue[0] if self.queue else None

    def pop(self) -> Job:
        with self._cond:
            return self.queue.popleft()

    def close(self) -> list[Job]:
        """Closed: what was queued, taken out."""
        with self._cond:
            self.closed = True
            left = list(self.queue)
            self.queue.clear()
            self._cond.notify_all()
            return left

    def qsize(self) -> int:
        return len(self.queue)
