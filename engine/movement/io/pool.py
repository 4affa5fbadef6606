"""ReadPool: reader threads that read (or fault in) spans of files into caller buffers.

See engine/movement/io/__init__.py for the modes and the request model, engine/movement/io/base.py for the
contract every pool keeps; engine/movement/io/uring_pool.py is the same contract over io_uring.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

from engine.movement.io.base import PoolBase
from engine.movement.io.files import truncated
from engine.movement.io.reads import fault_in, read_piece


class _Gather:
    """Completes one outer Future when all pieces of a split span are done."""

    def __init__(self, outer: concurrent.futures.Future, pieces: int, result):
        self._outer = outer
        self._left = pieces
        self._result = result
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            if self._error is None and error is not None:
                self._error = error
            self._left -= 1
            if self._left:
                return
        if self._error is not None:
            self._outer.set_exception(self._error)
        else:
            self._outer.set_result(self._result)
        self._result = None


class ReadPool(PoolBase):
    """A pool of reader threads for one io_mode. Safe to share between threads."""

    backend = "threads"

    def _start(self) -> None:
        io_mode, io_threads = self.io_mode, self.io_threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"colibri-io-{io_mode}-{i}", daemon=True)
                         for i in range(io_threads)]
        for w in self._workers:
            w.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.files.refuse_new()
        for _ in self._workers:
            self._jobs.put(None)
        for w in self._workers:
            w.join()
        self.files.close()

    # ---- workers ----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(*job)
            # The job's buffer (an expert store slot) must not stay referenced by this idle
            # worker's frame: the slot goes back to the arena when its last reference does.
            del job

    def _run(self, fut, gather, result, fn, args) -> None:
        if gather is None and not fut.set_running_or_notify_cancel():
            return  # cancelled while queued: never read
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - delivered through the Future
            if gather is None:
                fut.set_exception(exc)
            else:
                gather.piece_done(exc)
            return
        if gather is None:
            fut.set_result(result)
        else:
            gather.piece_done(None)

    def _enqueue(self, outer, result, pieces, fn, make_args) -> None:
        """One job per piece; a single-piece span completes its Future straight from the worker."""
        if len(pieces) == 1:
            self._jobs.put((outer, None, result, fn, make_args(*pieces[0])))
            return
        if not outer.set_running_or_notify_cancel():
            return
        gather = _Gather(outer, len(pieces), result)
        for lo, hi in pieces:
            self._jobs.put((outer, gather, None, fn, make_args(lo, hi)))

    # ---- pread modes ------------------------------------------------------------------------

    def _submit_pread(self, outer, path: str, offset: int, length: int, into) -> None:
        _fd, _direct, view, result, start, end = self._window(path, offset, length, into)
        # Bytes each piece must deliver; the direct window's tail past `end` is padding.
        self._enqueue(outer, result, self._pieces(start, start + len(view)), self._read_piece,
                      lambda lo, hi: (path, view[lo - start : hi - start], lo, min(hi, end) - lo, offset, length))

    def _read_piece(self, path, dest, pos, need, req_offset, req_length) -> None:
        read_piece(self.files, self.stats, path, dest, pos, need, req_offset, req_length)

    # ---- mmap mode ----------------------------------------------------------------------------

    def _submit_mmap(self, outer, path: str, offset: int, length: int) -> None:
        mapping = self.files.mapping(path)
        end = offset + length
        if end > len(mapping):
            raise truncated(path, offset, length, len(mapping))
        result = memoryview(mapping)[offset:end]
        start, stop = self.device_window(path, offset, length)
        self._enqueue(outer, result, self._pieces(start, stop), self._fault_in,
                      lambda lo, hi: (mapping, lo, hi))

    def _fault_in(self, mapping, lo: int, hi: int) -> None:
        fault_in(self.stats, mapping, lo, hi)
