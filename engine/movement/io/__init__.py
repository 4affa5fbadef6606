"""Reading byte ranges of weight files: the read pools behind every I/O mode.

One request is one contiguous span of a file (an expert's three adjacent matrices, say). It
is read with one read straight into the destination buffer: a slot of the expert store's
arena (`into=`), or a fresh page-aligned buffer for callers that have none. A span larger than
`chunk_size` is split into at most `io_threads` pieces so one big span still keeps that many
reads going; smaller spans are never split, so the per-request Python work is one hand-off
and one Future per span.

Two backends issue the reads (EngineConfig.io_backend; `open_read_pool` picks):
  threads   ReadPool: `io_threads` reader threads, one blocking `preadv` each. os.preadv
            releases the GIL, which is what makes a thread pool a real I/O queue here.
  uring     UringPool: one io_uring ring (the uring-api package); the caller's thread submits,
            one completion thread reaps, at most `io_threads` reads in the kernel at once.
            Unavailable where the kernel or a container refuses io_uring (a ConfigError;
            "auto" falls back to threads). Direct and buffered modes only: mmap is always
            the threads. Which one measured faster in the engine: docs/BENCHMARKS.md.
Both keep one contract (engine/movement/io/base.py), and one conformance suite runs over both
(tests/test_io.py).

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

The modules, one job each:
  stats       the counters every reader adds to
  files       the descriptors (with the O_DIRECT fallback) and the mappings, opened once per file
  base        the contract both pools share: argument checks, the direct window, span splitting
  reads       what a reader thread does for one piece: the preadv loop, or the mmap fault-in
  pool        ReadPool: the threads, the queue, completing Futures
  uring_pool  UringPool: the ring, the queue depth, the completion thread
  choose      open_read_pool: the pool an engine config asks for
  trace       ReadTrace: every decode read as JSON lines (`colibri bench --read-trace`)
(Page alignment arithmetic is engine/base/align.py, shared with the slots.)
"""

from engine.base.config import IO_BACKENDS, IO_MODES

from engine.base.align import ALIGN, align_down, align_up, direct_window_bytes
from engine.movement.io.choose import open_read_pool
from engine.movement.io.pool import ReadPool
from engine.movement.io.stats import IOStats
from engine.movement.io.uring_pool import UringPool, uring_unavailable

__all__ = ["ALIGN", "IO_BACKENDS", "IO_MODES", "IOStats", "ReadPool", "UringPool", "align_down", "align_up",
           "direct_window_bytes", "open_read_pool", "uring_unavailable"]
