"""Long-lived weights in one anonymous mapping that asks for transparent huge pages.

Why: resident decode reads every active weight once a token, ~0.55 GB on demo bf16, spread
over hundreds of 1-3 MiB matrices. In 4 KiB pages that is one TLB miss (a page walk) per 4 KiB
streamed, and torch's / malloc's large allocations only get 2 MiB pages where THP is "always";
most distributions ship "madvise". One mapping, 2 MiB aligned, with MADV_HUGEPAGE, lets the
kernel back the weights with 2 MiB pages (512x fewer TLB entries), and the matrix-vector
kernels read closer to plain-read bandwidth (docs/BENCHMARKS.md, "Resident weights on huge pages").

Nothing here is needed for correctness: where THP is off, or the kernel refuses the advice,
the arena is an ordinary anonymous mapping with 4 KiB pages and every byte is the same.
The bytes are the callers' to fill, straight from the file (take() for ResidentExperts' spans,
allocator() for the runtime's dense tensors), so nothing is read twice or held twice; views of
them keep the mapping alive (torch.frombuffer holds a reference to the exported buffer).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
PIECE_ALIGN = 64  # each piece starts on a cache line: AVX-512 loads never split one
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's THP setting as the bracketed word of `enabled` (always, madvise, never), or
    "unavailable" where the file is missing (no THP in this kernel, or not Linux)."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class HugePageArena:
    """`nbytes` of anonymous memory, handed out in 64-byte-aligned pieces by take(); its start is on
    a 2 MiB boundary so whole huge pages can back it. Pages are faulted in as they are written.

    whole_pages: only the whole 2 MiB pages inside `nbytes` get the advice, and the rest (the tail
    past the last whole one) is kept on 4 KiB pages even where THP is "always": a huge page there
    would hold up to 2 MiB beyond `nbytes`, which the streaming store's slots (a memory plan's
    bytes, under a cgroup's limit) must not. Resident weights take the tail's huge page too."""

    def __init__(self, nbytes: int, whole_pages: bool = False):
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        # One huge page of slack to move the start onto a 2 MiB boundary; the slack before it is
        # never touched, so it never costs memory.
        # MAP_PRIVATE: Python's default for an anonymous map is MAP_SHARED, which is shmem, and
        # shmem follows shmem_enabled (usually "never"), not the advice.
        size = _round_up(max(nbytes, 1), HUGE_PAGE) + HUGE_PAGE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._start = (-base) % HUGE_PAGE
        self.address = base + self._start
        self.advised = False
        huge = nbytes // HUGE_PAGE * HUGE_PAGE if whole_pages else _round_up(max(nbytes, 1), HUGE_PAGE)
        try:
            if huge:
                self._map.madvise(_MADV_HUGEPAGE, self._start, huge)
                self.advised = True
            if whole_pages:  # the tail and the slack after it: never a huge page, whatever the default
                self._map.madvise(_MADV_NOHUGEPAGE, self._start + huge, size - self._start - huge)
        except (OSError, ValueError):  # THP not built in, or a kernel that refuses: 4 KiB pages
            pass
        self._used = 0
        self._view = memoryview(self._map)

    def window(self, offset: int, nbytes: int) -> memoryview:
        """The writable bytes offset..offset+nbytes of the arena (no bookkeeping: the caller places them)."""
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes {offset}..{offset + nbytes} are outside an arena of {self.nbytes}")
        return self._view[self._start + offset:self._start + offset + nbytes]

    def advise(self, option: int, offset: int, nbytes: int) -> None:
        """madvise(option) over the arena's bytes offset..offset+nbytes (OSError where the kernel refuses)."""
        if nbytes:
            self._map.madvise(option, self._start + offset, nbytes)

    def take(self, nbytes: int) -> memoryview:
        """The next `nbytes` (a writable memoryview), starting on a 64-byte boundary."""
        offset = _round_up(self._used, PIECE_ALIGN)
        if offset + nbytes > self.nbytes:
            raise MemoryError(f"arena of {self.nbytes} bytes cannot give {nbytes} more at {offset}")
        self._used = offset + nbytes
        return self._view[self._start + offset:self._start + offset + nbytes]

    def allocator(self):
        """alloc(nbytes) -> a uint8 tensor over the next `nbytes` (64-byte aligned). All of them are
        slices of one tensor, one storage, so pieces placed back to back can be viewed as one matrix
        (the model's fused q/k/v). Past the arena's end it returns a plain torch.empty: a size
        estimate that fell short costs the huge pages of the rest, never the load."""
        whole = (torch.frombuffer(self._view[self._start:self._start + self.nbytes], dtype=torch.uint8)
                 if self.nbytes else None)

        def alloc(nbytes: int) -> torch.Tensor:
            offset = _round_up(self._used, PIECE_ALIGN)
            if whole is None or offset + nbytes > self.nbytes:
                return torch.empty(nbytes, dtype=torch.uint8)
            self._used = offset + nbytes
            return whole[offset:offset + nbytes]

        return alloc

    def huge_bytes(self) -> int | None:
        """Bytes of this mapping backed by huge pages now (AnonHugePages in /proc/self/smaps), or
        None where smaps cannot be read."""
        return mapping_huge_bytes(self.address - self._start)


def arena_bytes(sizes) -> int:
    """The arena size that holds pieces of these sizes, each aligned as take() places them."""
    return sum(_round_up(n, PIECE_ALIGN) for n in sizes)


def mapping_huge_bytes(address: int, smaps: Path = Path("/proc/self/smaps")) -> int | None:
    """AnonHugePages of the mapping that contains `address`, in bytes; None if unreadable."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None
