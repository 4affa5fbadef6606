"""What a worker does for one piece of a request: the preadv loop, or the mmap fault-in."""

from __future__ import annotations

import errno
import mmap
import os
import time

from engine.base.align import ALIGN, align_up
from engine.movement.io.files import FileTable, truncated
from engine.movement.io.stats import IOStats

# Linux >= 5.14 can fault a whole range in with one call; the mmap module does not name it yet.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def read_piece(files: FileTable, stats: IOStats, path: str, dest: memoryview, pos: int, need: int,
               req_offset: int, req_length: int) -> None:
    """Fill `dest` from `path` at `pos`; at least `need` bytes must exist (the rest is O_DIRECT
    padding past the request's end)."""
    fd, flags = files.fd(path)
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
                fd = files.fall_back(path, fd)
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
        stats.add(bytes_read=asked, requests=1, read_seconds=elapsed)
    if got < need:
        raise truncated(path, req_offset, req_length, pos + got)


def fault_in(stats: IOStats, mapping: mmap.mmap, lo: int, hi: int) -> None:
    # Fault the pages in on the worker so the disk read overlaps compute instead of
    # happening as page faults inside the matmul. WILLNEED first reads exactly [lo, hi) in
    # large requests; populating alone faults the range in through the kernel's mmap
    # read-around, which reads read_ahead_kb around each missing page (8 MiB on this VM's
    # disk, for a 3 MiB expert): measured 3x the bytes asked for from the disk, whose
    # neighbours' pages then evict the ones in use from a budget-sized cgroup
    # (docs/benchmarks-history.md, 2026-12-01 10:09-11:35, "mmap io_mode: read-around").
    t0 = time.perf_counter()
    try:
        mapping.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
        mapping.madvise(_MADV_POPULATE_READ, lo, hi - lo)
    except OSError:
        # Kernels before 5.14: ask for read-ahead, then touch one byte per page.
        mapping.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
        for p in range(lo, hi, mmap.PAGESIZE):
            mapping[p]
    stats.add(bytes_read=hi - lo, requests=1, read_seconds=time.perf_counter() - t0)
