"""The expert store's lookup counters and the stats() built from them (a mixin of StreamingExperts).

Every expert lookup is exactly one of: a hit in a cache tier, a lookahead read that landed or is in
flight (prefetched_used), or a demand read; streaming_experts.py counts them as they happen, and the
lookahead's recall (of the experts a layer needed, how many were predicted). reset_stats() starts a
new window for them and for the read figures (reading_store.py); stats() reports both.
"""

from __future__ import annotations

from collections import Counter


class ExpertCounters:
    """reset_stats / stats over the store's counters, its `cache`, `arena` and `slot_overflows`."""

    def reset_stats(self) -> None:
        self.reset_window()
        self.recall_hits = self.recall_total = 0
        self.demand_reads = self.prefetch_reads = self.prefetched_used = 0
        self.lookups = 0
        self.tier_hits: dict[str, int] = {}
        # (layer, expert) → reads started since reset_stats: what shows a prefill group reading each
        # expert at most once per layer (DESIGN.md, "Reuse: many tokens per read").
        self.read_counts: Counter = Counter()

    def stats(self) -> dict:
        """Counters since reset_stats(). Every expert lookup is exactly one of: a hit in a cache
        tier (kept from an earlier use), a prefetch that lookahead issued in time or in flight,
        or a demand read; the three rates add up to 1."""
        n = self.lookups
        return {
            **self.read_figures(),
            "expert_lookups": n,
            "hit_rate": {name: (self.tier_hits.get(name, 0) / n if n else None) for name in self.cache.tier_names},
            "prefetch_coverage": self.prefetched_used / n if n else None,
            "demand_read_rate": self.demand_reads / n if n else None,
            "cache_items": {name: s["items"] for name, s in self.cache.stats().items()},
            "demand_reads": self.demand_reads,
            "prefetch_reads": self.prefetch_reads,
            "prefetched_used": self.prefetched_used,
            "lookahead_recall": self.recall_hits / self.recall_total if self.recall_total else None,
            **(self.arena.stats() if self.arena is not None else {}),
            "slot_overflows": self.slot_overflows,
        }
