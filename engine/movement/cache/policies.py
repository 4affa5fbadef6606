"""The cache contract (ExpertCache) and its three eviction policies.

A cache holds opaque values (an expert's tensors; never None, which reads as a miss) under
hashable keys ((layer, expert)), charged by the byte count the caller gives. Every policy
obeys the same rules, checked by one conformance suite: bytes_used never exceeds capacity_bytes, an item larger than the room the
policy can make is refused (put returns False) without evicting anything, and get() is the
only call that moves hit/miss counters.

Policies:
  lru     evict the least recently used item. (A frequency-admission variant, as in TinyLFU,
          simulates better below one token's working set but measured slower on the demo
          under 1 GiB: 29% vs 38% RAM hits, 288 vs 253 MiB read per token, docs/BENCHMARKS.md;
          it lives in benchmarks/tuning/cache_policies.py only.)
  lfu     evict the least frequently requested item, ties to the least recently used.
          A key's count is its get() calls (hits and misses), at least 1 once inserted, so a
          prefetched item that was never asked for ranks as one use. Counts survive eviction
          (they are the key's popularity, not its residency), so a hot expert pushed out by a
          burst comes back with its history and is not the next victim. Keys are bounded by
          layers × experts, so the table stays small.
  pinned  keys from a recorded routing histogram (hottest first) are pinned, never evicted,
          up to pinned_fraction of the capacity; everything else is LRU in the remaining room.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.base.config import CACHE_POLICIES
from engine.base.errors import ConfigError

Key = Hashable
Evicted = tuple[Key, Any, int]  # (key, value, nbytes)


# Share of the RAM cache the pinned policy reserves for the recorded hottest experts (the engine's
# store and the cost model's routing simulation both use it).
PINNED_FRACTION = 0.5


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    inserts: int = 0
    rejected: int = 0  # put() calls refused because the item could not fit

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class ExpertCache(ABC):
    """One cache tier with a byte capacity. Thread-safe; every method takes the lock."""

    policy: str = ""

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"cache capacity must be a non-negative integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.stats = CacheStats()
        self._entries: dict[Key, tuple[Any, int]] = {}
        # get() calls per key, hits and misses, kept after eviction (the key's popularity, not
        # its residency; keys are bounded by layers × experts): lfu's order.
        self._requests: Counter[Key] = Counter()
        self._lock = threading.RLock()

    # ---- contract --------------------------------------------------------------------------

    def get(self, key: Key) -> Any | None:
        """The cached value, or None; counts a hit or a miss and updates the policy's order."""
        with self._lock:
            self._requests[key] += 1
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._on_hit(key)
            return entry[0]

    def note_request(self, key: Key) -> None:
        """A request served without asking the cache (a lookahead read that landed in time):
        it counts toward the key's popularity, not as a hit or a miss."""
        with self._lock:
            self._requests[key] += 1

    def peek(self, key: Key) -> Any | None:
        """The cached value, or None, without touching stats or the eviction order."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry[0]

    def put(self, key: Key, value: Any, nbytes: int) -> bool:
        """Insert (or replace) `key`; evict per policy until it fits. False if it cannot fit."""
        return self.put_evicting(key, value, nbytes)[0]

    def put_evicting(self, key: Key, value: Any, nbytes: int) -> tuple[bool, list[Evicted]]:
        """put(), also returning what was evicted so a tier stack can demote it.

        Replacing a key removes the old entry first; if the new size cannot fit, the key ends
        up absent.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative integer, got {nbytes!r}")
        evicted: list[Evicted] = []
        with self._lock:
            if key in self._entries:
                self._remove_locked(key)
            if self.capacity_bytes == 0 or not self._fits_locked(key, nbytes) or not self._admits(key, nbytes):
                self.stats.rejected += 1
                return False, evicted
            self._plan_insert(key, nbytes)
            self._evict_to(self.capacity_bytes - nbytes, evicted)
            self._entries[key] = (value, nbytes)
            self.bytes_used += nbytes
            self._on_insert(key, nbytes)
            self.stats.inserts += 1
        return True, evicted

    def resize(self, capacity_bytes: int) -> list[Evicted]:
        """A new capacity (the cache borrows a drafter's idle memory, and gives it back: engine/run/
        mtp_drafter.py): what no longer fits is evicted per policy, and returned."""
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"cache capacity must be a non-negative integer, got {capacity_bytes!r}")
        evicted: list[Evicted] = []
        with self._lock:
            self.capacity_bytes = capacity_bytes
            self._on_resize()
            self._evict_to(capacity_bytes, evicted)
        return evicted

    def fits(self, key: Key, nbytes: int) -> bool:
        """Whether put(key, _, nbytes) would be accepted now (evictions allowed)."""
        with self._lock:
            return self.capacity_bytes > 0 and self._fits_locked(key, nbytes) and self._admits(key, nbytes)

    def nbytes_of(self, key: Key) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry[1]

    def pop(self, key: Key) -> tuple[Any, int] | None:
        """Remove `key` without counting it as an eviction; (value, nbytes) or None."""
        with self._lock:
            if key not in self._entries:
                return None
            return self._remove_locked(key)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._remove_locked(key)

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(items={len(self)}, bytes_used={self.bytes_used}, "
            f"capacity_bytes={self.capacity_bytes})"
        )

    # ---- policy hooks (called with the lock held) -------------------------------------------

    def _evict_to(self, limit: int, evicted: list[Evicted]) -> None:
        """Evict per policy until bytes_used <= limit, appending what left."""
        while self.bytes_used > limit:
            victim = self._victim()
            value, nbytes = self._remove_locked(victim)
            evicted.append((victim, value, nbytes))
            self.stats.evictions += 1

    def _remove_locked(self, key: Key) -> tuple[Any, int]:
        value, nbytes = self._entries.pop(key)
        self.bytes_used -= nbytes
        self._on_remove(key)
        return value, nbytes

    def _fits_locked(self, key: Key, nbytes: int) -> bool:
        """Room after evicting everything evictable (the key itself is already absent)."""
        return nbytes <= self.capacity_bytes - (self.bytes_used - self._evictable_bytes())

    def _evictable_bytes(self) -> int:
        return self.bytes_used

    def _admits(self, key: Key, nbytes: int) -> bool:
        """Whether the policy takes `key` (absent, and known to fit) at the price of the
        evictions it needs; the engine's policies take whatever fits (benchmarks/tuning/cache_policies.py overrides it)."""
        return True

    def _plan_insert(self, key: Key, nbytes: int) -> None:
        """Called once an insert is known to fit, before evictions make room for it."""

    def _on_resize(self) -> None:
        """Called once the capacity changed, before evictions bring bytes_used within it."""

    @abstractmethod
    def _on_hit(self, key: Key) -> None: ...

    @abstractmethod
    def _on_insert(self, key: Key, nbytes: int) -> None: ...

    @abstractmethod
    def _on_remove(self, key: Key) -> None: ...

    @abstractmethod
    def _victim(self) -> Key:
        """The next key to evict; only called when some evictable key exists."""


class LRUCache(ExpertCache):
    policy = "lru"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def _on_hit(self, key):
        self._order.move_to_end(key)

    def _on_insert(self, key, nbytes):
        self._order[key] = None

    def _on_remove(self, key):
        del self._order[key]

    def _victim(self):
        return next(iter(self._order))


class LFUCache(ExpertCache):
    """O(1) LFU: residents sit in per-count buckets, each an LRU-ordered OrderedDict."""

    policy = "lfu"

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._bucket_of: dict[Key, int] = {}

    def frequency(self, key: Key) -> int:
        with self._lock:
            return self._requests[key]

    def _on_hit(self, key):
        self._unbucket(key)
        self._bucket(key, self._requests[key])

    def _on_insert(self, key, nbytes):
        count = max(self._requests[key], 1)
        self._requests[key] = count
        self._bucket(key, count)

    def _on_remove(self, key):
        self._unbucket(key)

    def _victim(self):
        # Distinct counts among residents are few, so min() over them is cheap.
        return next(iter(self._buckets[min(self._buckets)]))

    def _bucket(self, key, count):
        self._buckets.setdefault(count, OrderedDict())[key] = None
        self._bucket_of[key] = count

    def _unbucket(self, key):
        count = self._bucket_of.pop(key)
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]


class PinnedCache(ExpertCache):
    """Hottest-first pinned keys that never leave, LRU for everything else.

    A pinned key is pinned when it is put and the pin budget has room. If a hotter pinned key
    arrives and the budget is full of colder ones, the coldest are demoted to the LRU part, so
    the pinned set converges on the hottest prefix whatever order the keys are loaded in.
    """

    policy = "pinned"

    def __init__(self, capacity_bytes: int, pinned_keys: Sequence[Key] = (), pinned_fraction: float = PINNED_FRACTION):
        super().__init__(capacity_bytes)
        if not 0.0 <= pinned_fraction <= 1.0:
            raise ConfigError(f"pinned_fraction must be within [0, 1], got {pinned_fraction!r}")
        self._rank: dict[Key, int] = {}
        for key in pinned_keys:
            self._rank.setdefault(key, len(self._rank))
        self.pinned_fraction = pinned_fraction
        self.pin_budget = int(capacity_bytes * pinned_fraction)
        self._pinned: dict[Key, int] = {}  # key -> nbytes
        self.pinned_bytes = 0
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._pin_next: bool = False

    @property
    def pinned(self) -> frozenset:
        with self._lock:
            return frozenset(self._pinned)

    def _colder_pinned(self, key) -> list[Key]:
        """Pinned keys colder than `key`, coldest first."""
        rank = self._rank[key]
        return sorted((k for k in self._pinned if self._rank[k] > rank), key=self._rank.__getitem__, reverse=True)

    def _pinnable(self, key, nbytes) -> bool:
        if key not in self._rank:
            return False
        room = self.pin_budget - self.pinned_bytes
        if nbytes <= room:
            return True
        return nbytes <= room + sum(self._pinned[k] for k in self._colder_pinned(key))

    def _evictable_bytes(self):
        return self.bytes_used - self.pinned_bytes

    def _fits_locked(self, key, nbytes):
        # A pinnable key always fits: pinned bytes stay within the budget, which is <= capacity,
        # and everything else can be evicted (or demoted) to make room.
        return self._pinnable(key, nbytes) or super()._fits_locked(key, nbytes)

    def _plan_insert(self, key, nbytes):
        self._pin_next = self._pinnable(key, nbytes)
        if not self._pin_next:
            return
        for colder in self._colder_pinned(key):
            if self.pinned_bytes + nbytes <= self.pin_budget:
                break
            self.pinned_bytes -= self._pinned.pop(colder)
            self._lru[colder] = None  # it was hot by the histogram: most recently used

    def _on_resize(self):
        # The pin budget is the same share of the new capacity: the coldest pinned keys over it
        # join the LRU part, as the least recently used (they go first where the cache shrinks).
        self.pin_budget = int(self.capacity_bytes * self.pinned_fraction)
        demoted = []
        for colder in sorted(self._pinned, key=self._rank.__getitem__, reverse=True):
            if self.pinned_bytes <= self.pin_budget:
                break
            self.pinned_bytes -= self._pinned.pop(colder)
            demoted.append(colder)
        for key in reversed(demoted):  # the coldest ends up first
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)

    def _on_hit(self, key):
        if key in self._lru:
            self._lru.move_to_end(key)

    def _on_insert(self, key, nbytes):
        if self._pin_next:
            self._pinned[key] = nbytes
            self.pinned_bytes += nbytes
        else:
            self._lru[key] = None
        self._pin_next = False

    def _on_remove(self, key):
        if key in self._pinned:
            self.pinned_bytes -= self._pinned.pop(key)
        else:
            del self._lru[key]

    def _victim(self):
        return next(iter(self._lru))


def make_cache(
    policy: str,
    capacity_bytes: int,
    *,
    pinned_keys: Sequence[Key] = (),
    pinned_fraction: float = PINNED_FRACTION,
) -> ExpertCache:
    """A cache of the named policy; pinned_keys/pinned_fraction only matter for "pinned"."""
    if policy == "lru":
        return LRUCache(capacity_bytes)
    if policy == "lfu":
        return LFUCache(capacity_bytes)
    if policy == "pinned":
        return PinnedCache(capacity_bytes, pinned_keys, pinned_fraction)
    raise ConfigError(f"cache_policy must be one of {', '.join(CACHE_POLICIES)}, got {policy!r}")
