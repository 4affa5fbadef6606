"""Expert caches: one contract, three eviction policies, a fast→slow tier stack, and the routing
histogram the pinned policy reads.

    policies.py  ExpertCache (the contract every policy obeys) and lru, lfu, pinned; make_cache
    tiered.py    TieredCache: exclusive tiers, demotion on eviction, promotion on a slow hit
    histogram.py routing histograms: save, load, hottest keys
"""

from engine.movement.cache.policies import (
    CACHE_POLICIES, PINNED_FRACTION, CacheStats, ExpertCache, LFUCache, LRUCache, PinnedCache, make_cache,
)
from engine.movement.cache.histogram import (
    ROUTING_SCHEMA, hottest_keys, routing_histogram_load, routing_histogram_save,
)
from engine.movement.cache.tiered import TieredCache

__all__ = ["CACHE_POLICIES", "PINNED_FRACTION", "ROUTING_SCHEMA", "CacheStats", "ExpertCache", "LFUCache", "LRUCache", "PinnedCache",
           "TieredCache", "hottest_keys", "make_cache", "routing_histogram_load", "routing_histogram_save"]
