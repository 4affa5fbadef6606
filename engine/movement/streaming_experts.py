"""StreamingExperts: a MoE model's routed experts read from disk per use (a dense model's layers:
streaming_layers.py; the pool, counters and read figures both share: reading_store.py; the
lookup counters and stats(): expert_counters.py).

Per layer:
    for_each_expert   cache hits are computed at once; reads already in flight (issued by a
                      hint) and demand reads for the rest are computed as they land, in
                      completion order, so a hit never waits behind the slowest miss.
                      in_order=True (a layer-major prefill's group): computed in the order
                      asked; a read that lands early waits in its slot for its turn.
    hint_experts      router lookahead predicted these for a later layer: start reading.

Memory is the plan's, exactly: every read lands in a slot of one pre-faulted arena
(engine/movement/slots.py) sized for the cache entries plus `max_inflight` reads; no read, demand or
lookahead, starts while `max_inflight` are held. Lookahead reads a layer did not use are
cancelled (still queued) or dropped when they land (already reading) as soon as that layer
has routed, so they never hold budget past it.

Everything here runs on the compute thread except the reads themselves (the read pool's reader
threads or io_uring completion thread): they only put finished reads on a queue, which the
compute thread drains.
"""

from __future__ import annotations

import queue
import time
import weakref
from concurrent.futures import Future, wait

import torch

from engine.base.config import EngineConfig
from engine.format.layout import ExpertLayout, tensors_from_buffers
from engine.movement.cache import PINNED_FRACTION, TieredCache, hottest_keys, make_cache, routing_histogram_load
from engine.movement.cache_loan import CacheLoan
from engine.movement.expert_counters import ExpertCounters
from engine.movement.io import align_up
from engine.movement.plan import MemoryPlan
from engine.movement.reading_store import ReadingStore
from engine.movement.slots import SlotArena
from engine.movement.store import ExpertStore

# How long a read waits for a worker to release a slot before it counts an overflow: a guard
# against a budget bug, far above the slowest pread.
SLOT_WAIT_GUARD_S = 5.0


def _to_device(value, device: str):
    return tuple(t.to(device, non_blocking=False) for t in value)


class _Read:
    """One expert's read: a Future per span, all landing in one slot (`lease`)."""

    __slots__ = ("key", "futures", "left", "wanted", "prefetch", "__weakref__")

    def __init__(self, key, futures: list[Future], prefetch: bool):
        self.key = key
        self.futures = futures
        self.left = len(futures)  # spans not yet landed; counted down on the compute thread only
        self.wanted = True  # False once its layer routed elsewhere: dropped when it lands
        self.prefetch = prefetch


class StreamingExperts(CacheLoan, ExpertCounters, ReadingStore, ExpertStore):
    def __init__(self, layout: ExpertLayout, config: EngineConfig, plan: MemoryPlan, dtype: torch.dtype,
                 lendable_bytes: int = 0):
        self.layout = layout
        self.dtype = dtype
        self.plan = plan
        self.open_reads(config)
        self.max_inflight = max(plan.max_inflight_experts, 1)
        # The RAM cache borrows a drafter's idle memory, from the start (engine/movement/cache_loan.py)
        spare = self.open_loan(layout, config, plan, dtype, lendable_bytes)
        # mmap reads are views of the page cache: nothing to land in, so no arena.
        self.arena = (None if config.io_mode == "mmap" else
                      SlotArena(plan.slot_bytes, plan.arena_slots, spare=spare, lent=True))
        pinned = []
        if config.cache_policy == "pinned" and config.routing_histogram:
            pinned = hottest_keys(routing_histogram_load(config.routing_histogram))
        tiers = []
        if plan.gpu_cache_bytes:
            tiers.append(("vram", make_cache("lru", plan.gpu_cache_bytes), "cuda"))
        tiers.append(("ram", make_cache(config.cache_policy, self.lent_cache_bytes(), pinned_keys=pinned,
                                          pinned_fraction=PINNED_FRACTION), "cpu"))
        self.cache = TieredCache(tiers, to_device=_to_device)
        self.reads: dict[tuple[int, int], _Read] = {}  # in flight
        self.ready: dict[tuple[int, int], _Read] = {}  # landed lookahead reads, not yet used
        self.orphans: set[_Read] = set()  # in flight, no longer wanted: held until they land
        self._landed: queue.SimpleQueue = queue.SimpleQueue()
        self.predicted: dict[int, set[int]] = {}
        self.slot_overflows = 0
        self._held = 0  # landed reads taken out of `ready` by for_each_expert, not yet computed
        self.reset_stats()
        if pinned:
            self._preload(pinned)

    # --- the ExpertStore contract ----------------------------------------------------------

    def for_each_expert(self, layer, experts, fn, in_order: bool = False) -> None:
        if in_order:
            self._in_order(layer, experts, fn)
            return
        # Sorted first, computed after: the demand reads go out before any expert is computed, so
        # a prefill group's long computes of the prefetched and cached experts run under them.
        landed, hits, waiting, to_read = self._sort_requests(layer, experts)
        self._held = len(landed)  # out of `ready` but still in their slots: _room counts them
        try:
            self._submit_demand(to_read, waiting)
            while landed:
                read = landed.pop(0)
                self.cache.note_request(read.key)  # still a use of the expert: lfu's popularity counts it
                self._compute(read, fn)
                self._held -= 1
                read = None  # a consumed read's slot belongs to the cache now, or to nobody
                self._submit_demand(to_read, waiting)
        finally:
            self._held = 0
        for key in hits:
            hit = self.cache.get(key)
            if hit is None:  # evicted since it was looked at (a landed expert took its place): read it
                self.demand_reads += 1
                to_read.append(key)
                continue
            tier, value = hit
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1
            fn(key[1], value)
            del value, hit
        while waiting or to_read:
            self._submit_demand(to_read, waiting)
            if not waiting:  # every slot is held by lookahead for later layers: give one up
                self._give_up_lookahead(layer)
                continue
            read = self._next_landed(stall=True)
            if read.key in waiting and read.wanted:
                waiting.discard(read.key)
                self._compute(read, fn)
            else:
                self._landed_elsewhere(read)
            read = None

    def _in_order(self, layer, experts, fn) -> None:
        """for_each_expert with fn called in the order of `experts` (a layer-major group adds each
        expert's rows straight into its output, so the order is the bits). A read that lands before
        its turn waits in its slot (the read budget: at most max_inflight are held); a hit is taken
        from the cache at its turn; demand reads go out in the order asked, as room allows."""
        rank = {(layer, e): i for i, e in enumerate(experts)}
        landed, hit_list, waiting, to_read = self._sort_requests(layer, experts)  # to_read: in the order asked
        held = {read.key: read for read in landed}  # landed before their turn, each in its slot
        del landed  # `held` alone refers to them: a computed read must leave no reference to its slot
        lookahead = set(held)  # landed from a hint before this call
        hits = set(hit_list)
        self._held = len(held)  # out of `ready` but still in their slots: _room counts them

        def take_landed(block: bool) -> None:
            """This layer's reads that landed (waiting for one if `block`) move to `held`."""
            if block:
                read = self._next_landed(stall=True)
                if read.key in waiting and read.wanted:
                    self.ready[read.key] = read
                else:
                    self._landed_elsewhere(read)
            for k in [k for k in waiting if k in self.ready]:
                held[k] = self.ready.pop(k)
                waiting.discard(k)
                self._held += 1

        try:
            self._submit_demand(to_read, waiting)
            for key in rank:
                if key in hits:
                    hit = self.cache.get(key)
                    if hit is not None:
                        tier, value = hit
                        self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1
                        fn(key[1], value)
                        del value, hit
                        continue
                    self.demand_reads += 1  # evicted since it was looked at (a landed expert took its place)
                    to_read.insert(0, key)  # the one due: first in line
                while key not in held:
                    take_landed(block=False)
                    if key in held:
                        break
                    self._submit_demand(to_read, waiting)
                    if key in waiting:
                        take_landed(block=True)
                    elif (self.orphans or any(k[0] != layer for k in self.ready)
                          or any(k[0] != layer for k in self.reads)):
                        self._give_up_lookahead(layer)
                    elif held:
                        # Every slot is this layer's and none holds the one due (a hit when looked at,
                        # evicted since): the latest-due landed read is offered to the cache (or dropped,
                        # to be read again at its turn), so the one due can be read.
                        late = max(held, key=rank.__getitem__)
                        self._keep(late, self._value(held.pop(late)))
                        self._held -= 1
                        if late in self.cache:
                            hits.add(late)
                        else:
                            self.demand_reads += 1
                            to_read.append(late)
                            to_read.sort(key=rank.__getitem__)
                    elif waiting:  # every slot reads a later expert of this layer: one lands, then goes
                        take_landed(block=True)
                    else:
                        raise RuntimeError("read budget exhausted with nothing in flight (max_inflight < 1?)")
                read = held.pop(key)
                if key in lookahead:
                    self.cache.note_request(key)  # still a use of the expert: lfu's popularity counts it
                self._compute(read, fn)
                self._held -= 1
                read = None  # a consumed read's slot belongs to the cache now, or to nobody
                self._submit_demand(to_read, waiting)
        finally:
            self._held = 0

    def _sort_requests(self, layer, experts) -> tuple[list, list, set, list]:
        """One layer's experts, counted and sorted by where each is: (reads the lookahead landed in
        time, cache hits, reads still in flight, reads to submit), each in the order of `experts`."""
        self.fetched += len(experts)
        self._drain()
        needed = set(experts)
        self._release_mispredicted(layer, needed)
        predicted = self.predicted.pop(layer, None)
        if predicted is not None:
            self.recall_hits += len(predicted & needed)
            self.recall_total += len(needed)
        landed, hits, to_read = [], [], []
        waiting: set[tuple[int, int]] = set()
        for e in experts:
            key = (layer, e)
            self.lookups += 1
            read = self.ready.pop(key, None)
            if read is not None:  # lookahead read it in time
                self.prefetched_used += 1
                landed.append(read)
            elif key in self.cache:
                hits.append(key)
            elif key in self.reads:
                self.prefetched_used += 1
                waiting.add(key)
            else:
                self.demand_reads += 1
                to_read.append(key)
        return landed, hits, waiting, to_read

    def _submit_demand(self, to_read: list, waiting: set) -> None:
        """Start the demand reads the read budget has room for (in the order asked)."""
        while to_read and self._room():
            key = to_read.pop(0)
            self.reads[key] = self._submit(key, prefetch=False)
            waiting.add(key)

    def hint_experts(self, layer, experts) -> None:
        self._drain()
        self.predicted[layer] = set(experts)
        for e in experts:
            key = (layer, e)
            if key in self.reads or key in self.ready or key in self.cache:
                continue
            if not self._room():
                return  # read buffers are budgeted: never more than max_inflight held
            self.reads[key] = self._submit(key, prefetch=True)
            self.prefetch_reads += 1

    # --- reads -----------------------------------------------------------------------------

    def _room(self) -> bool:
        return len(self.reads) + len(self.ready) + len(self.orphans) + self._held < self.max_inflight

    def _submit(self, key, prefetch: bool) -> _Read:
        loc = self.layout.location(*key)
        lease = self._lease(key)
        futures, at = [], 0
        for s in loc.spans:
            into = None
            if lease is not None:
                size = self.pool.buffer_bytes(s.offset, s.length)
                into = memoryview(lease)[at:at + size]
                at += align_up(size)
            futures.append(self.pool.submit(s.path, s.offset, s.length, into=into))
            if self.tracer is not None:
                self.tracer.submitted(s.path, s.offset, s.length, key[0], futures[-1])
        read = _Read(key, futures, prefetch)
        self.read_counts[key] += 1
        # A weak reference: a strong one would make read <-> future a cycle, which only the
        # garbage collector frees, and the slot with it. The store holds the read until it lands.
        landed, ref = self._landed, weakref.ref(read)
        for f in futures:
            f.add_done_callback(lambda _f: landed.put(ref()))
        return read

    def _lease(self, key):
        """A free slot for key's read (a loan's repay evicts by key). The budget guarantees one, except for
        a cancelled read whose job a worker has not discarded yet (it still references its slot, maybe for
        a whole pread on a busy disk): wait for that release, not for a guess at how long it takes."""
        if self.arena is None:
            return None
        lease = self.arena.acquire(wait_s=SLOT_WAIT_GUARD_S, owner=key)
        if lease is None:
            self.slot_overflows += 1  # a budget bug if ever > 0: the pool allocates a buffer instead
        return lease

    def _next_landed(self, stall: bool) -> _Read:
        """Block until some read has all its spans landed (counting the wait as an I/O stall)."""
        while True:
            try:
                read = self._landed.get_nowait()
            except queue.Empty:
                t0 = time.perf_counter()
                read = self._landed.get()
                if stall:
                    self.stall_seconds += time.perf_counter() - t0
            if self._span_landed(read):
                return read

    def _drain(self) -> None:
        """Move reads that landed since the last call out of flight, without waiting."""
        while True:
            try:
                read = self._landed.get_nowait()
            except queue.Empty:
                return
            if self._span_landed(read):
                self._landed_elsewhere(read)

    def _span_landed(self, read: _Read) -> bool:
        """Count one landed span of `read`; True (and out of flight) once all have landed."""
        read.left -= 1
        if read.left:
            return False
        if self.reads.get(read.key) is read:
            del self.reads[read.key]
        return True

    def _landed_elsewhere(self, read: _Read) -> None:
        """A read that landed while the compute thread was waiting for another one (or was
        cancelled: a cancelled span "lands" too, so every span arrives exactly once)."""
        if read in self.orphans:
            self.orphans.discard(read)  # nobody wants it: dropping it frees its slot
        elif read.wanted:
            self.ready[read.key] = read

    def _release_mispredicted(self, layer: int, needed: set[int]) -> None:
        for key in [k for k in self.ready if k[0] == layer and k[1] not in needed]:
            self._keep(key, self._value(self.ready.pop(key)))  # read already paid: offer it to the cache
        for key in [k for k in self.reads if k[0] == layer and k[1] not in needed]:
            self._abandon(self.reads.pop(key))

    def _give_up_lookahead(self, layer: int) -> None:
        """Free budget for this layer's demand reads (lookahead for later layers holds it all)."""
        if self.orphans:  # abandoned reads still reading: wait for one, its slot is then free
            self._landed_elsewhere(self._next_landed(stall=True))
            return
        later = [k for k in self.ready if k[0] != layer]
        if later:
            self.ready.pop(max(later))
            return
        later = [k for k in self.reads if k[0] != layer]
        if not later:
            raise RuntimeError("read budget exhausted with nothing in flight (max_inflight < 1?)")
        self._abandon(self.reads.pop(max(later)))

    def _abandon(self, read: _Read) -> None:
        """Cancel what is still queued; the read lands (or "lands" cancelled) and is dropped."""
        read.wanted = False
        self.orphans.add(read)
        for f in read.futures:
            f.cancel()  # a cancelled span's callback queues it at once

    def _result(self, read: _Read):
        return [f.result() for f in read.futures]  # re-raises a read error (e.g. truncated shard)

    def _value(self, read: _Read):
        """The landed read as the expert's compute tensors (views of its slot when dtypes match)."""
        loc = self.layout.location(*read.key)
        value = tensors_from_buffers(loc, self._result(read), self.dtype)
        if self.pool.io_mode == "mmap" and any(getattr(w, "strips", False) for w in value):
            for span in loc.spans:  # copied out of the mapping (read-only): its pages are not the expert
                self.pool.drop_range(span.path, span.offset, span.length)
        return value

    def _compute(self, read: _Read, fn) -> None:
        value = self._value(read)
        fn(read.key[1], value)
        # After the compute, so an eviction this causes frees a slot nobody is using.
        self._keep(read.key, value)

    def _keep(self, key, value) -> None:
        """Offer a used (or given-up) expert to the cache; if refused, its slot goes back now."""
        self.cache.put(key, value, self.plan.cache_entry_bytes)

    def _preload(self, keys) -> None:
        """Read the pinned experts up front, as many as the pinned share of the cache holds."""
        room = int(self.plan.cache_bytes * PINNED_FRACTION) // max(self.plan.cache_entry_bytes, 1)
        known = self.layout.keys()
        keys = [k for k in keys if k in known][:room]
        for start in range(0, len(keys), self.max_inflight):
            batch = [self._submit(key, prefetch=False) for key in keys[start:start + self.max_inflight]]
            for read in batch:
                wait(read.futures)
                self._keep(read.key, self._value(read))
        while not self._landed.empty():  # their completions were consumed above
            self._landed.get_nowait()

    # --- measurement and lifecycle ---------------------------------------------------------

    def _settle(self) -> None:
        """Cancel every read not yet started and wait for the rest, so nothing lands later."""
        for read in list(self.reads.values()) + list(self.orphans):
            for f in read.futures:
                f.cancel()
        wait([f for read in list(self.reads.values()) + list(self.orphans) for f in read.futures])
        while not self._landed.empty():
            self._landed.get_nowait()
        self.reads.clear()
        self.orphans.clear()
        self.ready.clear()
        self.predicted.clear()

    def clear_caches(self) -> None:
        """Forget every cached expert (a cold start), and every read in flight with it."""
        self._settle()
        for name in self.cache.tier_names:
            self.cache.tier(name).clear()

    def drop_page_cache(self) -> str:
        return self.drop_pages({s.path for key in self.layout.keys() for s in self.layout.location(*key).spans})

    def make_cold(self) -> str:
        self.clear_caches()
        how = "expert caches emptied, in-flight reads settled; " + self.drop_page_cache()
        if self.pool.io_mode != "mmap" and self.pool.effective_mode == "direct":
            how += "; reads are O_DIRECT"
        return how

    def close(self) -> None:
        self._settle()
        self.pool.close()
