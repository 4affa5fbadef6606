"""Which pool reads for an engine config: open_read_pool(io_mode, io_backend, ...)."""

from __future__ import annotations

from engine.base.config import IO_BACKENDS
from engine.base.errors import ConfigError

from engine.movement.io.pool import ReadPool
from engine.movement.io.stats import IOStats
from engine.movement.io.uring_pool import UringPool


def open_read_pool(io_mode: str, io_backend: str, io_threads: int, chunk_size: int,
                   stats: IOStats | None = None) -> ReadPool | UringPool:
    """The pool for `io_backend`; its `.backend` says which one really reads.

    mmap mode is always the threads (io_uring reads into buffers; mmap faults pages in). "uring"
    raises ConfigError where io_uring is unavailable; "auto" then falls back to the threads.
    """
    if io_backend not in IO_BACKENDS:
        raise ConfigError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
    if io_mode == "mmap" or io_backend == "threads":
        return ReadPool(io_mode, io_threads, chunk_size, stats=stats)
    try:
        return UringPool(io_mode, io_threads, chunk_size, stats=stats)
    except ConfigError:
        if io_backend == "uring":
            raise
        return ReadPool(io_mode, io_threads, chunk_size, stats=stats)
