"""The RAM expert cache borrowing a drafter's idle memory (a mixin of StreamingExperts).

A drafter's memory (the MTP layer's weights and KV cache) is charged to the memory plan beside the
expert cache. While the drafter is idle it lends those bytes (engine/run/mtp_drafter.py): `borrow`
grows the RAM tier by whole entries, `repay` shrinks it back before the drafter allocates them again
(the experts in the lent slots leave, then the least wanted: ExpertCache.resize). Where a cached expert is its arena slot, each
entry is a spare slot of the arena (engine/movement/slots.py: mapped at load, faulted in when lent,
its pages dropped when withheld), so the resident set follows the loan. Not with mmap reads: a cached
expert is page cache there, not the plan's bytes.

The loan is open from the start (`borrowed` = `borrowable` once the store is built): the drafter holds
nothing until its first draft repays it (engine/run/mtp_drafter.py), so an engine whose gate never
drafts runs with the cache, and the arena's huge pages, of the engine without the drafter.
"""

from __future__ import annotations

import torch

from engine.base.config import EngineConfig
from engine.format.layout import ExpertLayout
from engine.movement.plan import MemoryPlan

# How long repaying waits for a slot a landed read still holds: a guard against a bug in who holds what
# (between steps nothing should), far above any read
WITHHOLD_GUARD_S = 5.0


def loan_entries(plan: MemoryPlan, config: EngineConfig, lendable_bytes: int) -> int:
    """The whole RAM cache entries a drafter's idle `lendable_bytes` lend a store under `plan`: with what
    the plan's cache left below a whole entry, no more than it takes to hold every routed expert, none
    with mmap reads (a cached expert is page cache there, not the plan's bytes)."""
    entry = plan.cache_entry_bytes
    if config.io_mode == "mmap" or entry <= 0 or lendable_bytes <= 0:
        return 0
    lendable = lendable_bytes + plan.unspent_cache_bytes(config.cpu_cache_ratio)
    return min(lendable // entry, max(plan.routed_experts - plan.cache_slots, 0))


class CacheLoan:
    """borrow / repay over the store's `cache` (its "ram" tier), `arena` and `plan`."""

    def open_loan(self, layout: ExpertLayout, config: EngineConfig, plan: MemoryPlan, dtype: torch.dtype,
                  lendable_bytes: int) -> int:
        """Sets `borrowable` (whole entries, no more than it takes to hold every routed expert), lent from
        the start (`borrowed`; the caller builds the arena with them lent and the RAM tier with
        `lent_cache_bytes`) → the spare arena slots the store's arena needs for them. The lent bytes join
        what the plan's cache left below a whole entry: the lent cache then holds what a plan without the
        drafter would give it (one entry fewer had a copy workload whose working set is the cache's size
        miss on nearly every read)."""
        self.borrowable = loan_entries(plan, config, lendable_bytes)
        self.borrowed = self.borrowable
        self._slot_entries = layout.zero_copy(dtype)
        return self.borrowable if self._slot_entries else 0

    def lent_cache_bytes(self) -> int:
        """The RAM tier's capacity with the loan it holds now."""
        return self.plan.cache_bytes + self.borrowed * self.plan.cache_entry_bytes

    def borrow(self) -> int:
        """The RAM cache grows by the `borrowable` entries (the drafter freed their bytes first) →
        how many it borrowed."""
        if self.borrowed or not self.borrowable:
            return 0
        n = self.arena.lend(self.borrowable) if self._slot_entries else self.borrowable
        ram = self.cache.tier("ram")
        ram.resize(ram.capacity_bytes + n * self.plan.cache_entry_bytes)
        self.borrowed = n
        return n

    def repay(self) -> None:
        """The RAM cache gives back what it borrowed (the drafter allocates those bytes next): the experts
        in the lent slots evicted, then the least wanted where those held fewer than the loan, and the
        lent slots' pages dropped. Not any n slots: dropping a kept slot would split the huge pages
        under it for good (engine/movement/slots.py). Between steps, so no landed read is held."""
        n, self.borrowed = self.borrowed, 0
        if not n:
            return
        ram = self.cache.tier("ram")
        if self._slot_entries:
            for key in self.arena.lent_owners():  # (an in-flight read's key is not cached: nothing to pop)
                ram.pop(key)
        ram.resize(ram.capacity_bytes - n * self.plan.cache_entry_bytes)  # (the evicted die here: slots free)
        if self._slot_entries:
            taken = self.arena.withhold(n, wait_s=WITHHOLD_GUARD_S)
            if taken < n:  # a slot still held past the guard
                self.slot_overflows += n - taken
