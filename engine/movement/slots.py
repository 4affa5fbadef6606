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

Why on huge pages: an O_DIRECT read pins its destination's pages and hands the device one segment
per physically contiguous run, so an expert landing in 2 MiB pages is one segment, in 4 KiB pages
~100 (a 384 KiB expert): on this project's virtual disk 1.14x the read time (benchmarks/io/slot_pages.py).
So the slots lie in a 2 MiB-aligned mapping (engine/base/hugepages.py) whose whole huge pages ask for
THP, and nothing ever drops part of one: a huge page a MADV_DONTNEED cuts into is split for good, and
the slot dropped faults back in on 4 KiB pages.

Spare slots: after the kept ones in the same mapping. The expert cache borrows them while a drafter's
memory is idle (engine/run/mtp_drafter.py lends the MTP layer's); `lend(n)` faults n of them in and
hands them out; `withhold(n)` takes lent slots back and drops their pages (MADV_DONTNEED), so the
resident set shrinks by their bytes again. Only lent slots are ever withheld (the caller first evicts
the experts in them: `lent_owners`): had any free slot gone, each loan's end would have split the huge
pages under the slots the plan keeps (in a gated-off MTP engine, 12 of 12 MiB of them on huge pages
became 6 within 40 s of decoding). An arena whose spare slots start lent (`lent=True`, the store's:
a drafter's memory is the cache's until its first draft) lays out and faults in every slot as an
arena of that many kept slots would: the same huge pages as the engine without the drafter. A
withhold then splits the one huge page the kept and the spare slots share (the kept part keeps its
frames) and marks it and the rest not huge, so nothing fills the dropped bytes in again. Once every
spare slot is lent again, that huge page is asked for and collapsed back (MADV_COLLAPSE): else each
trial of the drafter would leave the arena one huge page short of the engine without it for good (a
gated-off MTP engine held 8 of 10 MiB on huge pages after its first trial, `off` 10). An arena whose
spare slots start withheld asks huge pages only of the kept slots' whole ones.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import time
import weakref

from engine.base.hugepages import HUGE_PAGE, HugePageArena
from engine.movement.io import align_up

# Linux >= 5.14: fault a whole range in, writable, with one call.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
# Linux >= 6.1: make a range's pages one huge page now, copying what they hold (Python 3.11 lacks the name).
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


class SlotArena:
    """`count` slots of `slot_bytes` (rounded up to pages), page-aligned, faulted in up front, and
    `spare` more after them (the module doc: lent while a drafter is idle): withheld, mapped but not
    faulted in, or with `lent` lent from the start, faulted in with the kept ones."""

    def __init__(self, slot_bytes: int, count: int, prefault: bool = True, spare: int = 0, lent: bool = False):
        if slot_bytes < 0 or count < 0 or spare < 0:
            raise ValueError(f"slot_bytes, count and spare must be >= 0, got {slot_bytes}, {count}, {spare}")
        self.slot_bytes = align_up(max(slot_bytes, 1))
        lent = lent and spare > 0
        self._kept, self._spare = count, spare  # slots 0..count-1 kept, count.. spare
        self.count = count + spare if lent else count  # slots that hold memory: handed out, free, or lent
        self._arena = HugePageArena(self.slot_bytes * (count + spare), whole_pages=True)
        if spare and not lent:
            self._not_huge_from(self.slot_bytes * count)  # a huge page reaching into them would hold their bytes
        if prefault and self.nbytes:
            self._prefault()
        self._free = collections.deque(range(self.count))  # append/popleft are atomic: finalizers may run on workers
        self._withheld = [] if lent else list(range(count + spare - 1, count - 1, -1))  # holding no pages
        self._lent: set[int] = set(range(count, count + spare)) if lent else set()  # (free or handed out)
        self._owners: dict[int, object] = {}  # a handed-out lent slot → what acquire() was told holds it
        # Reentrant: a finalizer (a release) can run in any thread at any allocation, including
        # in one that holds the lock already.
        self._lock = threading.RLock()
        self._released = threading.Condition(self._lock)
        self.in_use = 0
        self.peak_in_use = 0

    def _not_huge_from(self, offset: int) -> None:
        """No huge page from the one holding byte `offset` to the end (MADV_NOHUGEPAGE: pages already
        there stay what they are)."""
        start = offset // HUGE_PAGE * HUGE_PAGE
        try:
            self._arena.advise(_MADV_NOHUGEPAGE, start, self._arena.nbytes - start)
        except OSError:  # THP not built in: nothing to mark
            pass

    def _prefault(self) -> None:
        try:
            self._arena.advise(_MADV_POPULATE_WRITE, 0, self.nbytes)  # (the slots holding memory: kept, lent)
        except OSError:  # kernels before 5.14: touch every page
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self._arena.window(0, self.nbytes))),
                          0, self.nbytes)

    def acquire(self, wait_s: float = 0.0, owner=None):
        """A free slot as a writable ctypes array of slot_bytes, or None when all are still held
        after waiting up to `wait_s` seconds for a release. owner: what the slot will hold (the store's
        expert key), told back by lent_owners() while the slot is handed out."""
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
        lease = (ctypes.c_char * self.slot_bytes).from_buffer(self._arena.window(index * self.slot_bytes,
                                                                                  self.slot_bytes))
        weakref.finalize(lease, self._release, index)
        with self._lock:
            if owner is not None and index in self._lent:  # (only a loan's repay asks)
                self._owners[index] = owner
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return lease

    def _release(self, index: int) -> None:
        with self._released:
            self._owners.pop(index, None)
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

    def index_of(self, address: int) -> int | None:
        """The slot whose bytes hold `address`, or None outside every slot (mapped or lent)."""
        offset = address - self._arena.address
        return offset // self.slot_bytes if 0 <= offset < (self._kept + self._spare) * self.slot_bytes else None

    def lent_owners(self) -> list:
        """The owners acquire() was told of the lent slots handed out now: what must let go of them
        before withhold() can take them back."""
        with self._lock:
            return [self._owners[i] for i in sorted(self._owners)]

    def lend(self, n: int) -> int:
        """Fault in up to n withheld slots and hand them out with the free ones → how many."""
        with self._lock:
            n = min(n, len(self._withheld))
            for _ in range(n):
                index = self._withheld.pop()
                self._madvise(_MADV_POPULATE_WRITE, index)
                self.count += 1
                self._lent.add(index)
                self._free.append(index)
                self._released.notify()
            whole = n > 0 and not self._withheld
        if whole:  # (not under the lock: a collapse copies up to 2 MiB, and releases wait on the lock)
            self._huge_again()
        return n

    def _huge_again(self) -> None:
        """Every spare slot lent: the whole huge pages from the one kept and spare slots share onwards
        are the plan's bytes again, so they ask for huge pages and the split one is collapsed back now
        (best effort: a kernel before 6.1, a page pinned by a read in flight, or a cgroup at its limit
        leaves 4 KiB pages, as before; khugepaged may still collapse it later)."""
        start = self._kept * self.slot_bytes // HUGE_PAGE * HUGE_PAGE
        end = self.nbytes // HUGE_PAGE * HUGE_PAGE  # (the tail past the last whole page stays not huge)
        if end <= start:
            return
        try:
            self._arena.advise(_MADV_HUGEPAGE, start, end - start)
            self._arena.advise(_MADV_COLLAPSE, start, end - start)
        except OSError:
            pass

    def withhold(self, n: int, wait_s: float = 0.0) -> int:
        """Take up to n lent slots back out of use and drop their pages, waiting up to wait_s for the
        ones still handed out to be released → how many were taken (fewer only where lent slots stayed
        held past the wait, or fewer were lent). Never a kept slot (the module doc)."""
        taken = 0
        deadline = time.monotonic() + wait_s
        with self._released:
            while taken < n and self._lent:
                index = next((i for i in list(self._free) if i in self._lent), None)
                if index is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._released.wait(left)
                    continue
                self._free.remove(index)
                self._madvise(_MADV_DONTNEED, index)
                self._lent.discard(index)
                self._withheld.append(index)
                self.count -= 1
                taken += 1
        if taken:  # the huge page kept and spare slots share is split now: nothing may fill the dropped bytes in
            self._not_huge_from(self._kept * self.slot_bytes)
        return taken

    def _madvise(self, option: int, index: int) -> None:
        offset = index * self.slot_bytes
        try:
            self._arena.advise(option, offset, self.slot_bytes)
        except OSError:
            if option != _MADV_POPULATE_WRITE:
                raise
            window = self._arena.window(offset, self.slot_bytes)
            ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(window)), 0, self.slot_bytes)  # kernels before 5.14

    def huge_bytes(self) -> int | None:
        """The arena's bytes on huge pages now (None where smaps cannot be read)."""
        return self._arena.huge_bytes()

    def stats(self) -> dict:
        with self._lock:
            return {"slots": self.count, "slot_bytes": self.slot_bytes, "arena_bytes": self.nbytes,
                    "slots_in_use": self.in_use, "slots_peak": self.peak_in_use}
