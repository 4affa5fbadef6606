"""What every read pool shares, whatever issues its reads (reader threads or io_uring).

The contract (engine/movement/io/__init__.py has the modes): `submit` returns one Future per span,
resolving to a memoryview of exactly the bytes asked for; a span larger than `chunk_size` is
split into at most `io_threads` pieces; a Future cancelled before its read is issued is never
read; direct windows are widened to 4 KiB boundaries and a filesystem that refuses O_DIRECT
falls back to buffered once (`effective_mode`); errors reach the caller through the Future
(ModelFormatError for a truncated file, the OSError of the read otherwise); `close` lets
queued reads finish, then closes the files. Subclasses say how a piece is read.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading

from engine.base.config import IO_MODES
from engine.base.errors import ConfigError

from engine.base.align import align_down, align_up, aligned_buffer, direct_window_bytes
from engine.movement.io.files import FileTable
from engine.movement.io.stats import IOStats


class PoolBase:
    """Argument checks, the files, the direct window and span splitting: one copy for all pools."""

    backend = ""  # "threads" or "uring": what really issued the reads (the bench result records it)

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
        self.files = FileTable(io_mode)
        self._lock = threading.Lock()
        self._closed = False
        self._start()

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

    def device_window(self, path: str, offset: int, length: int) -> tuple[int, int]:
        """The file bytes [start, stop) a read of this span asks the device for, as the
        `bytes_read` counter counts them: pages around it for O_DIRECT and for mmap (clipped at
        the end of the file), the span itself for buffered reads or a direct file that fell back."""
        if self.io_mode == "mmap":
            return align_down(offset), min(align_up(offset + length), len(self.files.mapping(path)))
        _fd, flags = self.files.fd(path)
        return _pread_window(offset, length, bool(flags & os.O_DIRECT))

    def buffer_bytes(self, offset: int, length: int) -> int:
        """How large an `into` buffer a read of this range needs in this mode."""
        return direct_window_bytes(offset, length) if self.io_mode == "direct" else length

    def submit(self, path: str, offset: int, length: int, into=None) -> concurrent.futures.Future:
        """Start reading `length` bytes of `path` at `offset`.

        The Future's result is a memoryview of exactly `length` bytes (writable except in
        mmap mode) that works with torch.frombuffer. With `into` (a writable, page-aligned
        buffer of at least buffer_bytes(offset, length)), the bytes land there and the view
        is a slice of it; otherwise the pool allocates the buffer. A Future cancelled before
        its read is issued is never read.
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

    def drop_range(self, path: str, offset: int, length: int) -> None:
        """Release the whole pages of [offset, offset + length) of `path` that a read mapped (mmap
        mode): unmapped from this process (madvise DONTNEED), then dropped from the page cache
        (posix_fadvise DONTNEED; pages a neighbour shares at either end stay). For bytes the engine
        has copied out (int4 strips): the copy is what the plan charges, the mapped pages would be
        the same expert counted twice in the memory cgroup."""
        mapping = self.files.mapped(os.fspath(path))
        if mapping is None:
            return
        start, end = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        """Start the readers (the arguments are checked and the file table exists)."""
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for the subclasses -------------------------------------------------------------------

    def _submit_pread(self, outer, path: str, offset: int, length: int, into) -> None:
        raise NotImplementedError

    def _submit_mmap(self, outer, path: str, offset: int, length: int) -> None:
        raise NotImplementedError

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Split [start, stop) across the readers only when it is larger than chunk_size."""
        size = stop - start
        n = min(self.io_threads, -(-size // self.chunk_size))
        if n <= 1:
            return [(start, stop)]
        step = align_up(-(-size // n))
        return [(p, min(p + step, stop)) for p in range(start, stop, step)]

    def _window(self, path: str, offset: int, length: int, into):
        """Where a pread-mode request lands: (fd, direct, view, result, start, end).

        `view` covers the file window [start, start + len(view)) (widened to pages for
        O_DIRECT), `result` is the caller's `length` bytes inside it; bytes past `end` are
        alignment padding that need not exist in the file.
        """
        fd, flags = self.files.fd(path)
        direct = bool(flags & os.O_DIRECT)
        end = offset + length
        start, stop = _pread_window(offset, length, direct)
        if into is None:
            view = memoryview(aligned_buffer(stop - start))
        else:
            view = memoryview(into).cast("B")
            if len(view) < stop - start:
                raise ValueError(f"read buffer of {len(view)} bytes is smaller than the {stop - start}-byte window")
            view = view[: stop - start]
        return fd, direct, view, view[offset - start : offset - start + length], start, end


def _pread_window(offset: int, length: int, direct: bool) -> tuple[int, int]:
    """O_DIRECT reads whole pages around the span; a buffered read, the span itself."""
    end = offset + length
    return (align_down(offset), align_up(end)) if direct else (offset, end)
