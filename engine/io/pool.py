"""ReadPool: reader threads that read (or fault in) spans of files into caller buffers.

See engine/io/__init__.py for the modes and the request model.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import queue
import threading

from engine.config import IO_MODES
from engine.errors import ConfigError

from .align import align_down, align_up, aligned_buffer, direct_window_bytes
from .files import FileTable, truncated
from .reads import fault_in, read_piece
from .stats import IOStats


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


class ReadPool:
    """A pool of reader threads for one io_mode. Safe to share between threads."""

    def __init__(
        self,
        io_mode: str,
        io_threads: int = 4,
        chunk_size: int = 4 << 20,  # the EngineConfig default
        stats: IOStats | None = None,
    ):
        if io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {io_mode!r}")
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"io_threads must be a positive integer, got {io_threads!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.io_mode = io_mode
        self.io_threads = io_threads
        # Direct pieces must start on block boundaries, so a direct chunk is whole pages.
        self.chunk_size = align_up(chunk_size) if io_mode == "direct" else chunk_size
        self.stats = stats if stats is not None else IOStats()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"colibri-io-{io_mode}-{i}", daemon=True)
                         for i in range(io_threads)]
        for w in self._workers:
            w.start()
        self._lock = threading.Lock()
        self.files = FileTable(io_mode)
        self._closed = False

    # ---- public -------------------------------------------------------------------------

    @property
    def effective_mode(self) -> str:
        """The mode reads really use: "buffered" once any direct file had to fall back."""
        return "buffered" if self.files.fell_back else self.io_mode

    def open_flags(self, path: str) -> int | None:
        """The flags the cached descriptor for `path` was opened with (None if not open)."""
        entry = self.files.cached(os.fspath(path))
        return None if entry is None else entry[1]

    def fileno(self, path: str) -> int | None:
        """The cached descriptor for `path`, for inspection (/proc/self/fdinfo); None if not open."""
        entry = self.files.cached(os.fspath(path))
        return None if entry is None else entry[0]

    def buffer_bytes(self, offset: int, length: int) -> int:
        """How large an `into` buffer a read of this range needs in this mode."""
        return direct_window_bytes(offset, length) if self.io_mode == "direct" else length

    def submit(self, path: str, offset: int, length: int, into=None) -> concurrent.futures.Future:
        """Start reading `length` bytes of `path` at `offset`.

        The Future's result is a memoryview of exactly `length` bytes (writable except in
        mmap mode) that works with torch.frombuffer. With `into` (a writable, page-aligned
        buffer of at least buffer_bytes(offset, length)), the bytes land there and the view
        is a slice of it; otherwise the pool allocates the buffer. A Future cancelled before
        a worker picks it up is never read.
        """
        path = os.fspath(path)
        if offset < 0 or length < 0:
            raise ValueError(f"negative offset or length: offset={offset} length={length}")
        if self._closed:
            raise RuntimeError("ReadPool is closed")
        outer: concurrent.futures.Future = concurrent.futures.Future()
        self.stats.add(bytes_requested=length)
        try:
            if length == 0:
                outer.set_running_or_notify_cancel()
                outer.set_result(memoryview(bytearray()))
            elif self.io_mode == "mmap":
                self._submit_mmap(outer, path, offset, length)
            else:
                self._submit_pread(outer, path, offset, length, into)
        except BaseException as exc:  # noqa: BLE001 - the caller sees it through the Future
            if not outer.done():
                if outer.set_running_or_notify_cancel():
                    outer.set_exception(exc)
        return outer

    def read(self, path: str, offset: int, length: int, into=None) -> memoryview:
        return self.submit(path, offset, length, into).result()

    def drop_page_cache(self, path: str) -> None:
        """Make the next read of `path` come from the disk.

        The file's pages are dropped from the page cache (posix_fadvise DONTNEED). A file this
        pool has mapped (mmap mode) is first unmapped from this process's page tables
        (madvise DONTNEED), since the kernel keeps mapped pages resident; views of the mapping
        stay valid and fault back in from the disk.
        """
        path = os.fspath(path)
        mapping = self.files.mapped(path)
        if mapping is not None:
            mapping.madvise(mmap.MADV_DONTNEED)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

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

    def __enter__(self) -> "ReadPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Split [start, stop) across workers only when it is larger than chunk_size."""
        size = stop - start
        n = min(self.io_threads, -(-size // self.chunk_size))
        if n <= 1:
            return [(start, stop)]
        step = align_up(-(-size // n))
        return [(p, min(p + step, stop)) for p in range(start, stop, step)]

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
        _fd, flags = self.files.fd(path)
        end = offset + length
        if flags & os.O_DIRECT:
            start, stop = align_down(offset), align_up(end)
        else:
            start, stop = offset, end
        if into is None:
            view = memoryview(aligned_buffer(stop - start))
        else:
            view = memoryview(into).cast("B")
            if len(view) < stop - start:
                raise ValueError(f"read buffer of {len(view)} bytes is smaller than the {stop - start}-byte window")
        result = view[offset - start : offset - start + length]
        # Bytes each piece must deliver; the direct window's tail past `end` is padding.
        self._enqueue(outer, result, self._pieces(start, stop), self._read_piece,
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
        start, stop = align_down(offset), min(align_up(end), len(mapping))
        self._enqueue(outer, result, self._pieces(start, stop), self._fault_in,
                      lambda lo, hi: (mapping, lo, hi))

    def _fault_in(self, mapping, lo: int, hi: int) -> None:
        fault_in(self.stats, mapping, lo, hi)
