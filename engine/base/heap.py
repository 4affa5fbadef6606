"""Keeping a long prefill's transient memory transient (engine/movement/plan.py charges one chunk).

Three things outlive a prefill pass's tensors and grow a process's resident set with every pass:

- oneDNN's primitive cache. bf16 matmuls of more than one row go through oneDNN, which caches a
  compiled primitive per shape, up to 1024 by default; a routed expert's row count differs from
  pass to pass, so a 2,000-token prompt fills it (+~70 MiB on demo-small, hidden 512). Capped at
  PRIMITIVE_CACHE_CAPACITY unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN reads the
  variable when it creates its first primitive, so this runs at import, before any matmul.
- ideep's cache above it (PyTorch's oneDNN wrapper): a per-thread LRU of matmul computations, one
  per shape, 1024 by default (LRU_CACHE_CAPACITY), each holding its primitive alive (~0.5 MiB
  whatever the matrix size). This was the large one: on demo (hidden 1024) a 2,048-token group
  gives each expert its own row count, and the resident set grew ~40 MiB per layer (+490 MiB over
  16 layers) where the plan charged 155 MiB, so groups of 1,024 and 2,048 tokens were OOM-killed
  under a 1 GiB cgroup. Capped the same way, read the same way (at its first matmul). Never 0:
  ideep crashes with an empty cache.
- glibc's heap: freed blocks stay mapped in the thread arenas. `release_freed()` (malloc_trim)
  hands them back after each pass; a no-op where the C library has no malloc_trim.

With both caps, the two caches together hold at most NATIVE_CACHE_BYTES on a computing thread
(measured: ~17 MiB for bf16 matmuls of any size, 8 MiB for fp32, after 300 distinct row counts);
the memory plan charges that beside a prefill's activations.

Measured (demo-small at 400 MiB, 2,000-token prompt in 256-token passes, peak RSS): 515 MiB with
neither, 492 MiB with the trim alone, 457 MiB with the cap alone, 423 MiB with both (an 8-token prompt: ~350 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PRIMITIVE_CACHE_CAPACITY = 32
PRIMITIVE_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"
# What the two capped caches can hold on the thread that computes (see above), rounded up.
NATIVE_CACHE_BYTES = 24 << 20

os.environ.setdefault(PRIMITIVE_CACHE_ENV, str(PRIMITIVE_CACHE_CAPACITY))
os.environ.setdefault(IDEEP_CACHE_ENV, str(PRIMITIVE_CACHE_CAPACITY))


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
