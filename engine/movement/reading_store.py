"""What both streaming stores share: a read pool over the checkpoint's files, its byte counters,
the measurement window, and the read figures their stats() report under the same keys (so bench,
the tuner and the server read either store alike).

    StreamingExperts   routed experts read into slots and tiered caches (streaming_experts.py)
    StreamingLayers    a dense model's layers read per forward pass (streaming_layers.py)
"""

from __future__ import annotations

import time

from engine.base.config import EngineConfig
from engine.movement.io import IOStats, open_read_pool
from engine.movement.store import WeightStore


class ReadingStore(WeightStore):
    """The read side both streaming stores share (a base of each, beside its own contract)."""

    streams = True

    def open_reads(self, config: EngineConfig) -> None:
        self.io_stats = IOStats()
        self.pool = open_read_pool(config.io_mode, config.io_backend, config.io_threads, config.chunk_size,
                                   stats=self.io_stats)
        self.tracer = None  # an engine/movement/io/trace.py ReadTrace while `colibri bench --read-trace` records

    def reset_window(self) -> None:
        """Start a new measurement window: the byte counters and the compute thread's I/O stall."""
        self.io_stats.reset()
        self.stall_seconds = 0.0
        self.window_start = time.perf_counter()

    def read_figures(self) -> dict:
        """The pool's modes, bytes and rate, and the stall, since reset_window()."""
        window = time.perf_counter() - self.window_start
        io = self.io_stats.snapshot()
        return {
            "io_mode_effective": self.pool.effective_mode,
            "io_backend_effective": self.pool.backend,
            "bytes_read": io["bytes_read"],
            "bytes_requested": io["bytes_requested"],
            "read_requests": io["requests"],
            "read_gbps": io["bytes_read"] / window / 1e9 if window > 0 else None,
            "io_stall_s": self.stall_seconds,
            "io_stall_fraction": self.stall_seconds / window if window > 0 else None,
        }

    def drop_pages(self, paths) -> str:
        """Drop these files' pages; says how (the mmap pool unmaps the mapped pages first)."""
        for path in paths:
            self.pool.drop_page_cache(path)
        how = "page cache dropped (posix_fadvise DONTNEED)"
        return how + (" after unmapping the mapped pages (madvise DONTNEED)" if self.pool.io_mode == "mmap" else "")

    def close(self) -> None:
        self.clear_caches()
        self.pool.close()
