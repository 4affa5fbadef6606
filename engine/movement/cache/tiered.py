"""A fast→slow stack of cache tiers (VRAM then RAM), exclusive: a key lives in one tier at most."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.movement.cache.policies import ExpertCache, Key
from engine.base.errors import ConfigError


def _same_value(value: Any, device: str) -> Any:
    return value


class TieredCache:
    """Exclusive fast→slow tiers (e.g. VRAM then RAM): a key lives in at most one tier.

    put() places an item in the fastest tier that can take it; what that evicts is demoted
    (moved with `to_device`) to the next tier instead of being dropped, so the tiers' capacities
    add up. A hit in a slower tier promotes the item to the fastest tier when `promote` is set.
    Each tier is `(name, cache)` or `(name, cache, device)`; device defaults to "cpu".
    """

    def __init__(
        self,
        tiers: Sequence[tuple],
        *,
        to_device: Callable[[Any, str], Any] | None = None,
        promote: bool = True,
    ):
        if not tiers:
            raise ConfigError("a tiered cache needs at least one tier")
        self._tiers: list[tuple[str, ExpertCache, str]] = []
        for tier in tiers:
            if len(tier) == 2:
                name, cache = tier
                device = "cpu"
            else:
                name, cache, device = tier
            self._tiers.append((name, cache, device))
        names = [t[0] for t in self._tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self._to_device = to_device or _same_value
        self.promote = promote
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.demotions = 0
        self._lock = threading.RLock()

    @property
    def tier_names(self) -> list[str]:
        return [t[0] for t in self._tiers]

    def tier(self, name: str) -> ExpertCache:
        for tier_name, cache, _device in self._tiers:
            if tier_name == name:
                return cache
        raise KeyError(name)

    def get(self, key: Key) -> tuple[str, Any] | None:
        """(name of the tier that held it, value) or None.

        Tiers are asked fast to slow, so a key found in a slower tier counts a miss in each
        faster one. A promoted value is returned as moved to the fastest tier's device.
        """
        with self._lock:
            for index, (name, cache, _device) in enumerate(self._tiers):
                value = cache.get(key)
                if value is None:
                    continue
                self.hits += 1
                for _slower, other, _d in self._tiers[index + 1:]:
                    other.note_request(key)  # its popularity, for a demotion there later
                if index > 0 and self.promote:
                    value = self._promote(key, index, value)
                return name, value
            self.misses += 1
            return None

    def note_request(self, key: Key) -> None:
        with self._lock:
            for _name, cache, _device in self._tiers:
                cache.note_request(key)

    def peek(self, key: Key) -> tuple[str, Any] | None:
        with self._lock:
            for name, cache, _device in self._tiers:
                value = cache.peek(key)
                if value is not None:
                    return name, value
            return None

    def put(self, key: Key, value: Any, nbytes: int) -> str | None:
        """Store in the fastest tier that accepts it; the tier's name, or None if none can."""
        with self._lock:
            for _name, cache, _device in self._tiers:
                cache.pop(key)
            return self._place(key, value, nbytes, first=0)

    def tier_of(self, key: Key) -> str | None:
        with self._lock:
            for name, cache, _device in self._tiers:
                if key in cache:
                    return name
            return None

    def __contains__(self, key: Key) -> bool:
        return self.tier_of(key) is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(len(cache) for _name, cache, _device in self._tiers)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def stats(self) -> dict[str, dict]:
        """Per tier: hits, misses, hit_rate, evictions, inserts, rejected, bytes, items, device."""
        with self._lock:
            return {
                name: {
                    **cache.stats.as_dict(),
                    "bytes_used": cache.bytes_used,
                    "capacity_bytes": cache.capacity_bytes,
                    "items": len(cache),
                    "device": device,
                    "policy": cache.policy,
                }
                for name, cache, device in self._tiers
            }

    # ---- movement ------------------------------------------------------------------------------

    def _promote(self, key: Key, index: int, value: Any) -> Any:
        slow = self._tiers[index][1]
        fast = self._tiers[0][1]
        nbytes = slow.nbytes_of(key)
        if not fast.fits(key, nbytes):
            return value
        slow.pop(key)
        self.promotions += 1
        self._place(key, value, nbytes, first=0)
        return fast.peek(key)

    def _place(self, key: Key, value: Any, nbytes: int, first: int) -> str | None:
        for index in range(first, len(self._tiers)):
            name, cache, device = self._tiers[index]
            if not cache.fits(key, nbytes):
                continue
            # to_device must be a no-op when the value already lives there (torch's .to is).
            stored, evicted = cache.put_evicting(key, self._to_device(value, device), nbytes)
            if not stored:  # fits() said yes under the same lock; kept for safety
                continue
            for old_key, old_value, old_nbytes in evicted:
                if index + 1 < len(self._tiers):
                    self.demotions += 1
                    self._place(old_key, old_value, old_nbytes, first=index + 1)
            return name
        return None
