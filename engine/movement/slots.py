"""The expert store's slot allocator: one pre-faulted arena of equal byte slots, reused forever.

Every expert read lands in a slot; the tensors torch builds over it are zero-copy views, so
a cached expert *is* its slot. Sizing comes from the memory plan (one slot per cache entry
plus the reads in flight), so the plan's read-buffer + cache figures are the memory used.

Slots are plain bytes: a bf16 expert, an int4 container or an MXFP4 block all fit the same
way; what the bytes mean is the layout's business (engine/format/layout.py).

A slot is handed out as a `ctypes` array over its bytes. torch.frombuffer keeps that object
alive for as long as any tensor view of it lives, so a weakref finalizer on it returns the
slot exactly when the last view dies: whether the cache evicted it, a read was given up, or
the compute thread dropped its last reference. Nothing can reuse a slot a tensor still reads.

Why pre-faulted: a fresh anonymous buffer per read costs one zero-fill page fault per 4 KiB
and an munmap (with a TLB shootdown) per eviction; the arena pays the faults once, at load.

Spare slots: address space mapped beyond `count` but never faulted in, so they hold no memory. The
expert cache borrows them while a drafter's memory is idle (engine/run/mtp_drafter.py lends the MTP
layer's): `lend(n)` faults n of them in and hands them out; `withhold(n)` takes n free slots back and
drops their pages (MADV_DONTNEED), so the resident set shrinks by their bytes again.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import time
import weakref

from engine.movement.io import ALIGN, align_up

# Linux >= 5.14: fault a whole range in, writable, with one call.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


class SlotArena:
    """`count` slots of `slot_bytes` (rounded up to pages), page-aligned, faulted in up front, and
    `spare` more mapped but not faulted in (the module doc: lent while a drafter is idle)."""

    def __init__(self, slot_bytes: int, count: int, prefault: bool = True, spare: int = 0):
        if slot_bytes < 0 or count < 0 or spare < 0:
            raise ValueError(f"slot_bytes, count and spare must be >= 0, got {slot_bytes}, {count}, {spare}")
        self.slot_bytes = align_up(max(slot_bytes, 1))
        self.count = count  # slots that hold memory: handed out, free, or lent
        # MAP_PRIVATE: Python's anonymous default, MAP_SHARED, is shmem, which ignores MADV_HUGEPAGE.
        self._arena = mmap.mmap(-1, max(self.slot_bytes * (count + spare), ALIGN),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if prefault and self.nbytes:
            self._prefault()
        self._free = collections.deque(range(count))  # append/popleft are atomic: finalizers may run on workers
        self._withheld = list(range(count, count + spare))  # mapped, holding no pages: lend() gives them out
        # Reentrant: a finalizer (a release) can run in any thread at any allocation, including
        # in one that holds the lock already.
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self.in_use = 0
        self.peak_in_use = 0

    def _prefault(self) -> None:
        try:
            self._arena.madvise(_MADV_HUGEPAGE)  # fewer TLB misses over a large arena, where THP allows
        except OSError:
            pass
        try:
            self._arena.madvise(_MADV_POPULATE_WRITE, 0, self.nbytes)  # (not the spare slots)
        except OSError:  # kernels before 5.14: touch every page
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self._arena)), 0, self.nbytes)

    def acquire(self, wait_s: float = 0.0):
        """A free slot as a writable ctypes array of slot_bytes, or None when all are still held
        after waiting up to `wait_s` seconds for a release."""
        deadline = None
        while True:
            try:
                index = self._free.popleft()
                break
            except IndexError:
                pass
            with self._released:
                if self._free:  # released meanwhile: a release appends under this lock
                    continue
                deadline = time.monotonic() + wait_s if deadline is None else deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._released.wait(left)
        lease = (ctypes.c_char * self.slot_bytes).from_buffer(self._arena, index * self.slot_bytes)
        weakref.finalize(lease, self._release, index)
        with self._lock:
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return lease

    def _release(self, index: int) -> None:
        with self._released:
            self.in_use -= 1
            self._free.append(index)
            self._released.notify()

    @property
    def nbytes(self) -> int:
        """The bytes the slots holding memory take (spare ones not lent hold none)."""
        return self.slot_bytes * self.count

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def withheld(self) -> int:
        """Slots that could be lent: mapped, holding no memory."""
        return len(self._withheld)

    def lend(self, n: int) -> int:
        """Fault in up to n withheld slots and hand them out with the free ones → how many."""
        with self._lock:
            n = min(n, len(self._withheld))
            for _ in range(n):
                index = self._withheld.pop()
                self._madvise(_MADV_POPULATE_WRITE, index)
                self.count += 1
                self._free.append(index)
                self._released.notify()
        return n

    def withhold(self, n: int, wait_s: float = 0.0) -> int:
        """Take up to n free slots out of use and drop their pages, waiting up to wait_s for releases
        → how many were taken (fewer only where slots stayed held past the wait)."""
        taken = 0
        deadline = time.monotonic() + wait_s
        with self._released:
            while taken < n:
                try:
                    index = self._free.popleft()
                except IndexError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._released.wait(left)
                    continue
                self._madvise(_MADV_DONTNEED, index)
                self._withheld.append(index)
                self.count -= 1
                taken += 1
        return taken

    def _madvise(self, option: int, index: int) -> None:
        try:
            self._arena.madvise(option, index * self.slot_bytes, self.slot_bytes)
        except OSError:
            if option != _MADV_POPULATE_WRITE:
                raise
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._arena)) + index * self.slot_bytes
            ctypes.memset(base, 0, self.slot_bytes)  # kernels before 5.14: touch every page

    def stats(self) -> dict:
        with self._lock:
            return {"slots": self.count, "slot_bytes": self.slot_bytes, "arena_bytes": self.nbytes,
                    "slots_in_use": self.in_use, "slots_peak": self.peak_in_use}
