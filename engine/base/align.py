"""Page alignment for O_DIRECT: windows widened to 4 KiB boundaries, page-aligned buffers (the read
pools, the slot arena, and the expert layout sizing a slot use it)."""

from __future__ import annotations

import mmap

ALIGN = 4096


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def direct_window_bytes(offset: int, length: int) -> int:
    """Bytes an O_DIRECT read of [offset, offset+length) transfers (and its buffer must hold)."""
    return align_up(offset + length) - align_down(offset)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous mappings start on a page boundary, which is what O_DIRECT needs.

    Only for callers without a slot (one-off reads, tests); the expert store reads into
    its pre-faulted arena instead, so the hot path maps nothing.
    """
    return mmap.mmap(-1, max(nbytes, 1))
