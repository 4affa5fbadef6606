"""Reading byte ranges of weight files: the read pool behind every I/O mode.

One request is one contiguous span of a file (an expert's three adjacent matrices, say). It
is read with one `preadv` by one of `io_threads` workers, straight into the destination
buffer: a slot of the expert store's arena (`into=`), or a fresh page-aligned buffer for
callers that have none. A span larger than `chunk_size` is split into at most `io_threads`
pieces so one big span still uses every worker; smaller spans are never split, so the
per-request Python work is one queue hand-off and one Future per span.

Modes:
  direct    O_DIRECT: the reads bypass the page cache, so a run measures the disk, not RAM.
            Buffers are page-aligned and read windows are widened to 4 KiB boundaries; the
            caller gets a view of just the bytes asked for. Where the filesystem refuses
            O_DIRECT (EINVAL at open or at a read) the file falls back to buffered
            with one warning, and `effective_mode` says so.
  buffered  pread through the page cache.
  mmap      the file is mapped once; a request pre-faults its pages on a worker (so the
            read overlaps compute like the other modes) and returns a zero-copy, read-only
            view of the mapping. Mapped pages are page cache; `into` is not used.

os.preadv releases the GIL, which is what makes a thread pool a real I/O queue here. (An
io_uring backend was tried against this pool: docs/BENCHMARKS.md, "I/O backend".)
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import mmap
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field

from engine.config import IO_MODES
from engine.errors import ConfigError, ModelFormatError

ALIGN = 4096

# Linux >= 5.14 can fault a whole range in with one call; the mmap module does not name it yet.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

log = logging.getLogger(__name__)


@dataclass
class IOStats:
    """Counters shared by every worker of a pool (and possibly several pools).

    bytes_requested: bytes callers asked for.
    bytes_read: bytes the device was asked to transfer, including O_DIRECT alignment padding.
    requests: read requests issued (one per span, or per piece of a span split across workers).
    read_seconds: summed worker time spent inside reads (exceeds wall time when parallel).
    """

    bytes_requested: int = 0
    bytes_read: int = 0
    requests: int = 0
    read_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self,
        *,
        bytes_requested: int = 0,
        bytes_read: int = 0,
        requests: int = 0,
        read_seconds: float = 0.0,
    ) -> None:
        with self._lock:
            self.bytes_requested += bytes_requested
            self.bytes_read += bytes_read
            self.requests += requests
            self.read_seconds += read_seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_requested": self.bytes_requested,
                "bytes_read": self.bytes_read,
                "requests": self.requests,
                "read_seconds": self.read_seconds,
            }

    def reset(self) -> None:
        with self._lock:
            self.bytes_requested = 0
            self.bytes_read = 0
            self.requests = 0
            self.read_seconds = 0.0


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def direct_window_bytes(offset: int, length: int) -> int:
    """Bytes an O_DIRECT read of [offset, offset+length) transfers (and its buffer must hold)."""
    return align_up(offset + length) - align_down(offset)


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous mappings start on a page boundary, which is what O_DIRECT needs.

    Only for callers without a slot (one-off reads, tests); the expert store reads into
    its pre-faulted arena instead, so the hot path maps nothing.
    """
    return mmap.mmap(-1, max(nbytes, 1))


def _truncated(path: str, offset: int, length: int, got_until: int) -> ModelFormatError:
    return ModelFormatError(
        f"truncated file {path}: {length} bytes wanted at offset {offset}, "
        f"but the data ends at offset {got_until}"
    )


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
        chunk_size: int = 1 << 20,
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
        self._fds: dict[str, tuple[int, int]] = {}  # path -> (fd, open flags)
        self._retired_fds: list[int] = []  # replaced by a fallback while a worker may use them
        self._maps: dict[str, mmap.mmap] = {}
        self._fell_back: set[str] = set()
        self._closed = False

    # ---- public -------------------------------------------------------------------------

    @property
    def effective_mode(self) -> str:
        """The mode reads really use: "buffered" once any direct file had to fall back."""
        with self._lock:
            return "buffered" if self._fell_back else self.io_mode

    def open_flags(self, path: str) -> int | None:
        """The flags the cached descriptor for `path` was opened with (None if not open)."""
        with self._lock:
            entry = self._fds.get(os.fspath(path))
        return None if entry is None else entry[1]

    def fileno(self, path: str) -> int | None:
        """The cached descriptor for `path`, for inspection (/proc/self/fdinfo); None if not open."""
        with self._lock:
            entry = self._fds.get(os.fspath(path))
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
        with self._lock:
            mapping = self._maps.get(path)
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
        for _ in self._workers:
            self._jobs.put(None)
        for w in self._workers:
            w.join()
        with self._lock:
            for fd, _flags in self._fds.values():
                os.close(fd)
            for fd in self._retired_fds:
                os.close(fd)
            self._fds.clear()
            self._retired_fds.clear()
            for mapping in self._maps.values():
                try:
                    mapping.close()
                except BufferError:
                    # Views handed out are still alive; the mapping goes when they do.
                    pass
            self._maps.clear()

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

    # ---- descriptors ----------------------------------------------------------------------

    def _fd(self, path: str) -> tuple[int, int]:
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                return entry
            if self._closed:
                raise RuntimeError("ReadPool is closed")
            flags = os.O_RDONLY
            if self.io_mode == "direct" and path not in self._fell_back:
                try:
                    fd = os.open(path, flags | os.O_DIRECT)
                    entry = (fd, flags | os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._note_fallback_locked(path, "open")
            if entry is None:
                entry = (os.open(path, flags), flags)
            self._fds[path] = entry
            return entry

    def _fall_back(self, path: str, direct_fd: int) -> int:
        """Replace a direct descriptor the filesystem refused to read through."""
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None and entry[0] == direct_fd:
                fd = os.open(path, os.O_RDONLY)
                self._fds[path] = (fd, os.O_RDONLY)
                # Another worker may be inside a read on the old descriptor right now;
                # closing it could let the number be reused under that read.
                self._retired_fds.append(direct_fd)
                self._note_fallback_locked(path, "read")
                return fd
            return self._fds[path][0]

    def _note_fallback_locked(self, path: str, where: str) -> None:
        first = not self._fell_back
        self._fell_back.add(path)
        if first:
            msg = (
                f"O_DIRECT refused by the filesystem of {path} (EINVAL at {where}); "
                "falling back to buffered reads, so this run goes through the page cache"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            log.warning(msg)

    # ---- pread modes ------------------------------------------------------------------------

    def _submit_pread(self, outer, path: str, offset: int, length: int, into) -> None:
        _fd, flags = self._fd(path)
        end = offset + length
        if flags & os.O_DIRECT:
            start, stop = align_down(offset), align_up(end)
        else:
            start, stop = offset, end
        if into is None:
            view = memoryview(_aligned_buffer(stop - start))
        else:
            view = memoryview(into).cast("B")
            if len(view) < stop - start:
                raise ValueError(f"read buffer of {len(view)} bytes is smaller than the {stop - start}-byte window")
        result = view[offset - start : offset - start + length]
        # Bytes each piece must deliver; the direct window's tail past `end` is padding.
        self._enqueue(outer, result, self._pieces(start, stop), self._read_piece,
                      lambda lo, hi: (path, view[lo - start : hi - start], lo, min(hi, end) - lo, offset, length))

    def _read_piece(
        self, path: str, dest: memoryview, pos: int, need: int, req_offset: int, req_length: int
    ) -> None:
        fd, flags = self._fd(path)
        direct = bool(flags & os.O_DIRECT)
        got = 0
        t0 = time.perf_counter()
        try:
            while got < len(dest):
                try:
                    n = os.preadv(fd, [dest[got:]], pos + got)
                except OSError as exc:
                    if not (direct and exc.errno == errno.EINVAL):
                        raise
                    # Alignment is ours and correct, so EINVAL means the filesystem refuses.
                    fd = self._fall_back(path, fd)
                    direct = False
                    continue
                if n == 0:
                    break
                got += n
                if direct and n % ALIGN:
                    break  # a direct read ends short only at EOF; the next offset is unaligned
        finally:
            elapsed = time.perf_counter() - t0
            asked = align_up(got) if direct else got
            self.stats.add(bytes_read=asked, requests=1, read_seconds=elapsed)
        if got < need:
            raise _truncated(path, req_offset, req_length, pos + got)

    # ---- mmap mode ----------------------------------------------------------------------------

    def _mapping(self, path: str) -> mmap.mmap:
        with self._lock:
            mapping = self._maps.get(path)
            if mapping is None:
                if self._closed:
                    raise RuntimeError("ReadPool is closed")
                fd = os.open(path, os.O_RDONLY)
                try:
                    if os.fstat(fd).st_size == 0:
                        raise _truncated(path, 0, 1, 0)
                    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)  # the mapping keeps the file alive
                self._maps[path] = mapping
            return mapping

    def _submit_mmap(self, outer, path: str, offset: int, length: int) -> None:
        mapping = self._mapping(path)
        end = offset + length
        if end > len(mapping):
            raise _truncated(path, offset, length, len(mapping))
        result = memoryview(mapping)[offset:end]
        start, stop = align_down(offset), min(align_up(end), len(mapping))
        self._enqueue(outer, result, self._pieces(start, stop), self._fault_in,
                      lambda lo, hi: (mapping, lo, hi))

    def _fault_in(self, mapping: mmap.mmap, lo: int, hi: int) -> None:
        # Fault the pages in on the worker so the disk read overlaps compute instead of
        # happening as page faults inside the matmul.
        t0 = time.perf_counter()
        try:
            mapping.madvise(_MADV_POPULATE_READ, lo, hi - lo)
        except OSError:
            # Kernels before 5.14: ask for read-ahead, then touch one byte per page.
            mapping.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
            for p in range(lo, hi, mmap.PAGESIZE):
                mapping[p]
        self.stats.add(bytes_read=hi - lo, requests=1, read_seconds=time.perf_counter() - t0)
