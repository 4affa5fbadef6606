"""ReadTrace: a record of every read a streaming store made, to replay its load on the disk.

`colibri bench --read-trace FILE` attaches one to the engine's store and writes what it
recorded; benchmarks/io/io_jobs.py turns it into fio iologs, so that the disk term of the
streaming bound is measured under the engine's own requests and load shape rather than under
fio's continuous random load (docs/BENCHMARKS.md, "The bound from the engine's own read trace").

Off by default, and then free: a store's `tracer` is None, the hook is one `is None` test per
span submitted, and no callback is added to any Future.

One record per span read: the file; the byte window the device was asked for (what the pool's
`bytes_read` counter counts: for O_DIRECT the 4 KiB-aligned window, for mmap the page-aligned
window clipped at the end of the file, else the span itself); the span as asked; the submit
and completion times (perf_counter seconds since the trace (re)started); the decode token
index and the layer. A read is recorded when it lands (stamped on the reader thread by the
Future's callback, before the compute thread sees it), in the window in which it landed,
which is when the pool counts its bytes too. A read cancelled before a worker took it was
never read and is not recorded.
"""

from __future__ import annotations

import json
import threading
import time
from functools import partial

from engine.base.durable import atomic_write_text

TRACE_FORMAT = "colibri-read-trace"
TRACE_VERSION = 1
FIELDS = ("file", "offset", "nbytes", "span_offset", "span_length", "submit_s", "complete_s", "token", "layer")


class ReadTrace:
    """Thread-safe: spans are submitted on the compute thread and land on reader threads."""

    def __init__(self, device_window):
        # The pool's own rule for which bytes a span reads (PoolBase.device_window), so the
        # trace counts exactly what the pool's bytes_read counter counts.
        self._device_window = device_window
        self._lock = threading.Lock()
        self.restart()

    def restart(self) -> None:
        """Forget what was recorded; times count from now, tokens from 0 (the store's stats reset)."""
        with self._lock:
            self._records: list[dict] = []
            self._t0 = time.perf_counter()
            self.token = 0

    def elapsed(self) -> float:
        """Seconds since the trace (re)started: the window its records cover."""
        return time.perf_counter() - self._t0

    def next_token(self) -> None:
        """The generation loop moved on to the next decode token."""
        self.token += 1

    def submitted(self, path: str, offset: int, length: int, layer: int, future) -> None:
        """A span of `path` was handed to the pool; its Future completes when it landed."""
        start, stop = self._device_window(path, offset, length)
        record = {"file": path, "offset": start, "nbytes": stop - start, "span_offset": offset, "span_length": length,
                  "submit_s": time.perf_counter() - self._t0, "complete_s": None, "token": self.token,
                  "layer": layer}
        future.add_done_callback(partial(self._landed, record))

    def _landed(self, record: dict, future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # never read (cancelled while queued), or not a whole read (the caller sees the error)
        with self._lock:
            record["complete_s"] = time.perf_counter() - self._t0
            self._records.append(record)

    def records(self) -> list[dict]:
        """What landed since the last restart, in submit order."""
        with self._lock:
            return sorted((dict(r) for r in self._records), key=lambda r: r["submit_s"])

    def bytes_read(self) -> int:
        with self._lock:
            return sum(r["nbytes"] for r in self._records)


def attach(store) -> ReadTrace | None:
    """Start tracing a streaming store's reads (None for a store that reads nothing)."""
    if store is None or not getattr(store, "streams", False) or not hasattr(store, "tracer"):
        return None
    store.tracer = ReadTrace(store.pool.device_window)
    return store.tracer


def trace_text(header: dict, records: list[dict]) -> str:
    """JSON lines: one header object, then one object per read."""
    head = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **header}
    lines = [json.dumps(head, sort_keys=True)] + [json.dumps(r, sort_keys=True) for r in records]
    return "\n".join(lines) + "\n"


def write_trace(path, header: dict, records: list[dict]) -> None:
    """Temp file + rename: a reader never sees half a trace."""
    atomic_write_text(path, trace_text(header, records))


def read_trace(path) -> tuple[dict, list[dict]]:
    """The header and the records of a trace file; ValueError naming the problem if it is not one."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty, not a read trace")
    try:
        head = json.loads(lines[0])
        records = [json.loads(line) for line in lines[1:]]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON lines ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT} file")
    if head.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: trace version {head.get('version')!r}, this tree reads {TRACE_VERSION}")
    for i, r in enumerate(records, 2):
        if not isinstance(r, dict) or any(k not in r for k in FIELDS):
            raise ValueError(f"{path}: line {i} is not a read record (needs {', '.join(FIELDS)})")
    return head, records
