"""The page cache of a model's files, for cold runs: drop it, check it is gone, or fill it.

Cold means the weights come from the disk: every file's pages are fsync'ed (dirty pages cannot be
dropped) and dropped with posix_fadvise(DONTNEED), which evicts exactly those files' pages and
leaves the rest of a shared box's cache alone (unlike /proc/sys/vm/drop_caches); `cached_bytes`
then asks the kernel (mincore) how much of them is still resident, so a cold figure carries
the proof of its coldness. Resident runs fill the cache first by reading every file through.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def _files(paths: list[Path]) -> list[Path]:
    return [f for root in paths for f in ([root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()))]


def drop_pages(paths: list[Path]) -> int:
    """posix_fadvise(DONTNEED) on every file under paths; returns the bytes covered."""
    total = 0
    for f in _files(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def cached_bytes(paths: list[Path]) -> int:
    """Bytes of the files' pages in the page cache now (mincore over a read-only mapping), so a
    cold row says the drop worked rather than assuming it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    page = mmap.PAGESIZE
    total = 0
    for f in _files(paths):
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {f}")
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore on {f}")
                total += sum(b & 1 for b in vec.raw) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def read_into_page_cache(paths: list[Path]) -> None:
    for f in _files(paths):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
