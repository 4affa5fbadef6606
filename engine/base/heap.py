"""Keeping a long prefill's transient memory transient (engine/movement/plan.py charges one chunk).

Two things outlive a prefill pass's tensors and grow a process's resident set with every pass:

- oneDNN's primitive cache. bf16 matmuls of more than one row go through oneDNN, which caches a
  compiled primitive per shape, up to 1024 by default; a routed expert's row count differs from
  pass to pass, so a 2,000-token prompt fills it (+~70 MiB on demo-small, hidden 512). Capped at
  PRIMITIVE_CACHE_CAPACITY unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN reads the
  variable when it creates its first primitive, so this runs at import, before any matmul.
- glibc's heap: freed blocks stay mapped in the thread arenas. `release_freed()` (malloc_trim)
  hands them back after each pass; a no-op where the C library has no malloc_trim.

Measured (demo-small at 400 MiB, 2,000-token prompt in 256-token passes, peak RSS): 515 MiB with
neither, 492 MiB with the trim alone, 457 MiB with the cap alone, 423 MiB with both (an 8-token prompt: ~350 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PRIMITIVE_CACHE_CAPACITY = 32
PRIMITIVE_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"

os.environ.setdefault(PRIMITIVE_CACHE_ENV, str(PRIMITIVE_CACHE_CAPACITY))


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def release_freed() -> None:
    """Return the heap's freed pages to the OS (glibc); the resident set then shows what is live."""
    if _TRIM is not None:
        _TRIM(0)
