"""The files a read pool reads: one descriptor (or one mapping) per path, opened on first use.

Direct mode opens with O_DIRECT; where the filesystem refuses it (EINVAL at open, or at a
read: see reads.py) the path falls back to a buffered descriptor, with one warning for the
pool, and the pool's effective mode becomes "buffered".
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import warnings

from engine.base.errors import ModelFormatError

log = logging.getLogger("engine.movement.io")


def truncated(path: str, offset: int, length: int, got_until: int) -> ModelFormatError:
    return ModelFormatError(
        f"truncated file {path}: {length} bytes wanted at offset {offset}, "
        f"but the data ends at offset {got_until}"
    )


class FileTable:
    """Descriptors and mappings of one pool, shared by its workers. Thread-safe."""

    def __init__(self, io_mode: str):
        self.io_mode = io_mode
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, int]] = {}  # path -> (fd, open flags)
        self._retired_fds: list[int] = []  # replaced by a fallback while a worker may use them
        self._maps: dict[str, mmap.mmap] = {}
        self._fell_back: set[str] = set()
        self._closed = False

    @property
    def fell_back(self) -> bool:
        with self._lock:
            return bool(self._fell_back)

    def cached(self, path: str) -> tuple[int, int] | None:
        """(fd, open flags) of the descriptor opened for `path`, or None if none is open."""
        with self._lock:
            return self._fds.get(path)

    def mapped(self, path: str) -> mmap.mmap | None:
        with self._lock:
            return self._maps.get(path)

    def mappings(self) -> list[mmap.mmap]:
        with self._lock:
            return list(self._maps.values())

    def fd(self, path: str) -> tuple[int, int]:
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

    def fall_back(self, path: str, direct_fd: int) -> int:
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
            # stacklevel 4: warn's caller <- fd() <- the pool's submit path <- ReadPool.submit
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
            log.warning(msg)

    def mapping(self, path: str) -> mmap.mmap:
        with self._lock:
            mapping = self._maps.get(path)
            if mapping is None:
                if self._closed:
                    raise RuntimeError("ReadPool is closed")
                fd = os.open(path, os.O_RDONLY)
                try:
                    if os.fstat(fd).st_size == 0:
                        raise truncated(path, 0, 1, 0)
                    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                finally:
                    os.close(fd)  # the mapping keeps the file alive
                self._maps[path] = mapping
            return mapping

    def refuse_new(self) -> None:
        """No more files open from now on (the pool is closing; queued reads of new files fail)."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
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
