"""The read counters shared by every worker of a pool (and possibly several pools)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


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
