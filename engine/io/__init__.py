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
io_uring backend was measured against this pool: docs/BENCHMARKS.md, "I/O backend".)

The modules, one job each:
  align   page alignment arithmetic and the fallback buffer for callers without a slot
  stats   the counters every worker adds to
  files   the descriptors (with the O_DIRECT fallback) and the mappings, opened once per file
  reads   what a worker does for one piece: the preadv loop, or the mmap fault-in
  pool    ReadPool: the workers, the queue, splitting spans and completing Futures
"""

from engine.config import IO_MODES

from .align import ALIGN, align_down, align_up, direct_window_bytes
from .pool import ReadPool
from .stats import IOStats

__all__ = ["ALIGN", "IO_MODES", "IOStats", "ReadPool", "align_down", "align_up", "direct_window_bytes"]
