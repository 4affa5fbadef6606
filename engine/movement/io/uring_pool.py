"""UringPool: the read pool's contract over one io_uring ring instead of reader threads.

The caller's thread fills a submission (one per span, or per piece of a span split past
chunk_size) and enters the kernel; one completion thread reaps the completions and resolves
the Futures. At most `io_threads` reads are in the kernel at once, so `io_threads` is the
queue depth here as it is the number of readers for ReadPool; the rest wait in a queue, where
a cancelled Future is dropped unread. Nothing per read is mapped or threaded: the kernel
writes straight into the caller's slot.

Modes: direct and buffered. mmap stays on the reader threads (its "read" is a page-fault
fill of a mapping, not a read into a buffer): `open_read_pool` gives mmap a ReadPool whatever
the backend, and the result's `io_backend_effective` says so.

The binding is `uring-api` (PyPI, a C extension bundling liburing). It holds the buffer it
reads into only until the completion is reaped, so a slot goes back to the arena when its
last reference does, as with the threads. Where the package is missing or the kernel refuses
io_uring (io_uring_setup fails with ENOSYS or EPERM in some containers and seccomp profiles),
constructing the pool raises one ConfigError line.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time

from engine.base.errors import ConfigError

from engine.base.align import ALIGN, align_up
from engine.movement.io.base import PoolBase
from engine.movement.io.files import truncated

# A read the kernel could not finish at once is simply issued again.
_RETRY = (errno.EINTR, errno.EAGAIN)


def _binding():
    try:
        import uring_api
    except ImportError as exc:
        raise ConfigError(f"io_backend 'uring' needs the uring-api package (pip install uring-api): {exc}") from None
    return uring_api


def open_ring(entries: int):
    """A ring of `entries` submissions, or one ConfigError line saying why there is none."""
    uring_api = _binding()
    try:
        return uring_api.Ring(entries=entries)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"io_backend 'uring': the kernel refused io_uring_setup ({why}; blocked in some "
                          "containers and seccomp profiles): use io_backend = \"threads\"") from None


def uring_unavailable() -> str | None:
    """Why io_uring cannot be used here, or None when a ring can be created."""
    try:
        open_ring(2).close()
    except ConfigError as exc:
        return str(exc)
    return None


class _Span:
    """One caller request: its Future, the view it resolves to, the pieces still reading."""

    __slots__ = ("future", "result", "left", "error", "path", "offset", "length", "split")

    def __init__(self, future, result, pieces: int, path: str, offset: int, length: int):
        self.future, self.result, self.left, self.error = future, result, pieces, None
        self.path, self.offset, self.length = path, offset, length
        self.split = pieces > 1  # a split span is running from submit on: it cannot be cancelled


class _Piece:
    """One read in the ring: `dest` filled from the file at `pos`; `need` bytes must exist."""

    __slots__ = ("span", "fd", "direct", "dest", "pos", "need", "got", "t0")

    def __init__(self, span: _Span, fd: int, direct: bool, dest: memoryview, pos: int, need: int):
        self.span, self.fd, self.direct, self.dest, self.pos, self.need = span, fd, direct, dest, pos, need
        self.got = 0
        self.t0 = 0.0  # set when first issued


class UringPool(PoolBase):
    """io_uring reads for direct and buffered mode. Safe to share between threads."""

    backend = "uring"

    def _start(self) -> None:
        if self.io_mode == "mmap":
            raise ConfigError("io_backend 'uring' reads into buffers; mmap mode uses the reader threads")
        # Room for every read in flight plus the wake-up the close sends.
        self._ring = open_ring(1 << self.io_threads.bit_length())
        self._queue: collections.deque[_Piece] = collections.deque()  # waiting for a place in the ring
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._stopping = False
        self._reaper = threading.Thread(target=self._reap, name=f"colibri-uring-{self.io_mode}", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Queued reads still run (as the threads' queue does); the kernel may be writing
            # into their buffers, so nothing is freed before the last one is reaped.
            while self._inflight or self._queue:
                self._idle.wait()
        self.files.refuse_new()
        self._stopping = True
        self._wake_reaper()
        self._ring.close()
        self.files.close()

    def _wake_reaper(self) -> None:
        """A one-byte read of /dev/zero with no piece attached: the completion that ends the
        reaper's wait. (Ring.break_wait does not wake a wait() blocked on another thread in
        uring-api 0.1.0rc5: its NOP is reaped silently and the wait parks again.)"""
        fd = os.open("/dev/zero", os.O_RDONLY)
        try:
            with self._lock:
                self._ring.prepare_read(fd, bytearray(1), 0, None)
                self._ring.submit()
            self._reaper.join()  # before the descriptor closes: the read is done with it then
        finally:
            os.close(fd)

    # ---- submission (the caller's thread) --------------------------------------------------

    def _submit_pread(self, outer, path: str, offset: int, length: int, into) -> None:
        fd, direct, view, result, start, end = self._window(path, offset, length, into)
        pieces = self._pieces(start, start + len(view))
        span = _Span(outer, result, len(pieces), path, offset, length)
        if span.split and not outer.set_running_or_notify_cancel():
            return
        reads = [_Piece(span, fd, direct, view[lo - start:hi - start], lo, max(0, min(hi, end) - lo))
                 for lo, hi in pieces]
        with self._lock:
            if self._closed:
                raise RuntimeError("ReadPool is closed")
            self._queue.extend(reads)
            done = self._issue_locked()
        self._resolve(done)

    def _issue_locked(self) -> list:
        """Move queued pieces into the ring while fewer than io_threads are in flight.

        Returns the spans this finished (a piece the ring refused), to resolve outside the lock.
        """
        issued, done = 0, []
        while self._queue and self._inflight < self.io_threads:
            piece = self._queue.popleft()
            span = piece.span
            if not piece.t0:
                if not span.split and not span.future.set_running_or_notify_cancel():
                    piece.span = piece.dest = span.result = None  # cancelled while queued: never read
                    continue
                piece.t0 = time.perf_counter()
            try:
                self._ring.prepare_read(piece.fd, piece.dest[piece.got:], piece.pos + piece.got, piece)
            except BaseException as exc:  # noqa: BLE001 - e.g. a read-only `into`: the caller's Future gets it
                done.append(self._finish_locked(piece, exc))
                continue
            self._inflight += 1
            issued += 1
        if issued:
            self._ring.submit()
        return done

    # ---- completion (the reaper thread) ------------------------------------------------------

    def _reap(self) -> None:
        while True:
            self._reap_batch(self._ring.wait())
            if self._stopping:
                return

    def _reap_batch(self, batch) -> None:
        # A method, so the batch's views of the slots go when it returns, not at the next wait.
        for completion in batch or ():
            piece = completion.take_user_data()
            if piece is not None:
                self._landed(piece, completion.res)

    def _landed(self, piece: _Piece, res: int) -> None:
        try:
            error, again = self._outcome(piece, res)
        except BaseException as exc:  # noqa: BLE001 - the reaper must live on: the span gets it
            error, again = exc, False
        with self._lock:
            self._inflight -= 1
            if again:
                self._queue.appendleft(piece)
            done = [] if again else [self._finish_locked(piece, error)]
            done += self._issue_locked()
            if not self._inflight and not self._queue:
                self._idle.notify_all()
        self._resolve(done)

    def _outcome(self, piece: _Piece, res: int) -> tuple[BaseException | None, bool]:
        """(error, issue again) for a completion of `res` bytes (or -errno)."""
        if res < 0:
            code = -res
            if code == errno.EINVAL and piece.direct:
                # Alignment is ours and correct, so EINVAL means the filesystem refuses.
                piece.fd, piece.direct = self.files.fall_back(piece.span.path, piece.fd), False
                return None, True
            if code in _RETRY:
                return None, True
            error = OSError(code, os.strerror(code))
        else:
            piece.got += res
            # A short read before the end is issued again for the rest (buffered reads may
            # return early); a direct read ends short only at EOF, at an unaligned offset.
            if not (res == 0 or piece.got >= len(piece.dest) or (piece.direct and res % ALIGN)):
                return None, True
            error = None
        self.stats.add(bytes_read=align_up(piece.got) if piece.direct else piece.got, requests=1,
                       read_seconds=time.perf_counter() - piece.t0)
        if error is None and piece.got < piece.need:
            span = piece.span
            error = truncated(span.path, span.offset, span.length, piece.pos + piece.got)
        return error, False

    def _finish_locked(self, piece: _Piece, error) -> tuple | None:
        """Count a piece out of its span: (future, error, view) once the span's last piece is."""
        span = piece.span
        piece.span = piece.dest = None
        if error is not None and span.error is None:
            span.error = error
        span.left -= 1
        if span.left:
            return None
        out = (span.future, span.error, span.result)
        span.result = None
        return out

    @staticmethod
    def _resolve(done: list) -> None:
        # Outside the pool's lock: a Future's callbacks may submit the next read.
        for item in done:
            if item is None:
                continue
            future, error, view = item
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(view)
