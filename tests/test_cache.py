"""Conformance suite over every cache policy, then policy-specific order, tiers, histograms."""

import json
import random
import threading
from collections import Counter

import pytest

from engine.movement.cache import (
    CACHE_POLICIES, ROUTING_SCHEMA, CacheStats, TieredCache, hottest_keys, make_cache,
    routing_histogram_load, routing_histogram_save,
)
from engine.base.errors import ConfigError


def _make(policy, capacity, **kw):
    return make_cache(policy, capacity, **kw)


# ---- contract, every policy ------------------------------------------------------------------


@pytest.fixture(params=CACHE_POLICIES)
def policy(request):
    return request.param


def test_get_after_put_and_peek(policy):
    cache = _make(policy, 100)
    assert cache.get("a") is None
    assert cache.put("a", "A", 10)
    assert "a" in cache and len(cache) == 1
    assert cache.get("a") == "A"
    assert cache.peek("a") == "A"
    assert cache.peek("b") is None
    assert cache.stats.hits == 1 and cache.stats.misses == 1 and cache.stats.inserts == 1


def test_capacity_respected_and_bytes_used_exact(policy):
    rng = random.Random(3)
    cache = _make(policy, 1000, pinned_keys=[(0, e) for e in range(5)], pinned_fraction=0.3)
    sizes = {}
    for step in range(2000):
        key = (rng.randrange(3), rng.randrange(40))
        if rng.random() < 0.5:
            cache.get(key)
        else:
            size = rng.randint(1, 180)
            if cache.put(key, object(), size):
                sizes[key] = size
        assert cache.bytes_used <= cache.capacity_bytes
        live = {k: sizes[k] for k in cache.keys()}
        assert cache.bytes_used == sum(live.values()), step
        assert len(cache) == len(live)


def test_eviction_makes_room(policy):
    cache = _make(policy, 30)
    for k in "abc":
        assert cache.put(k, k.upper(), 10)
    assert cache.put("d", "D", 10)
    assert len(cache) == 3 and cache.bytes_used == 30
    assert "d" in cache
    assert cache.stats.evictions == 1


def test_zero_capacity_caches_nothing(policy):
    cache = _make(policy, 0, pinned_keys=["a"])
    assert not cache.put("a", "A", 0)
    assert not cache.put("b", "B", 1)
    assert len(cache) == 0 and cache.bytes_used == 0
    assert cache.get("a") is None


def test_oversized_item_refused_without_evicting(policy):
    cache = _make(policy, 100)
    cache.put("a", "A", 60)
    assert not cache.put("big", "X", 101)
    assert "a" in cache and "big" not in cache
    assert cache.stats.evictions == 0 and cache.stats.rejected == 1


def test_replace_updates_bytes(policy):
    cache = _make(policy, 100)
    cache.put("a", "A", 60)
    cache.put("a", "A2", 30)
    assert cache.peek("a") == "A2" and cache.bytes_used == 30 and len(cache) == 1


def test_stats_counts(policy):
    cache = _make(policy, 20)
    cache.put("a", 1, 10)
    cache.put("b", 2, 10)
    cache.get("a")
    cache.get("a")
    cache.get("zz")
    cache.peek("b")  # peek never counts
    cache.put("c", 3, 10)  # evicts one
    assert (cache.stats.hits, cache.stats.misses) == (2, 1)
    assert cache.stats.inserts == 3 and cache.stats.evictions == 1
    assert cache.stats.hit_rate == pytest.approx(2 / 3)
    assert CacheStats().hit_rate == 0.0


def test_pop_and_clear(policy):
    cache = _make(policy, 100)
    cache.put("a", "A", 10)
    cache.put("b", "B", 20)
    assert cache.pop("a") == ("A", 10)
    assert cache.pop("a") is None
    assert cache.bytes_used == 20
    cache.clear()
    assert len(cache) == 0 and cache.bytes_used == 0
    assert cache.stats.evictions == 0


def test_put_evicting_reports_victims(policy):
    cache = _make(policy, 20)
    cache.put("a", "A", 10)
    cache.put("b", "B", 10)
    stored, evicted = cache.put_evicting("c", "C", 15)
    assert stored
    assert sum(n for _, _, n in evicted) >= 5
    for key, value, _n in evicted:
        assert key not in cache and value == key.upper()


def test_resize_evicts_per_policy_and_grows(policy):
    """A shrink evicts until bytes_used fits (returning what left, as put_evicting does); a grow keeps
    every entry and takes more (the expert cache borrowing a drafter's idle memory, and repaying it)."""
    pins = [("p", 0)]
    cache = _make(policy, 100, pinned_keys=pins, pinned_fraction=0.5)
    cache.put(("p", 0), "P", 10)
    for i in range(9):
        assert cache.put(("x", i), i, 10)
    cache.get(("x", 0))  # recent (lru) and frequent (lfu): kept by every policy
    before = set(cache.keys())
    evicted = cache.resize(40)
    assert cache.capacity_bytes == 40 and cache.bytes_used == 40 and len(cache) == 4
    assert {k for k, _v, _n in evicted} == before - set(cache.keys()) and len(evicted) == 6
    assert all(n == 10 for _k, _v, n in evicted)
    assert ("x", 0) in cache
    assert (("p", 0) in cache) == (policy == "pinned")  # the oldest entry: kept only where pinned
    assert cache.stats.evictions == 6
    assert cache.resize(80) == [] and len(cache) == 4
    for i in range(20, 24):
        assert cache.put(("y", i), i, 10)
    assert cache.bytes_used == 80 and len(cache) == 8
    assert cache.resize(0) and len(cache) == 0 and cache.bytes_used == 0
    with pytest.raises(ConfigError, match="non-negative"):
        cache.resize(-1)


def test_pinned_resize_below_its_pins_demotes_the_coldest():
    pins = [("p", i) for i in range(4)]
    cache = make_cache("pinned", 100, pinned_keys=pins, pinned_fraction=0.5)
    for key in pins:
        cache.put(key, key, 10)
    cache.put("a", 1, 10)
    cache.resize(40)  # pin budget 20: p3 and p2 demoted, the coldest (p3) the first to leave
    assert cache.pinned == {("p", 0), ("p", 1)} and cache.pin_budget == 20
    assert set(cache.keys()) == {("p", 0), ("p", 1), ("p", 2), "a"} and cache.bytes_used == 40
    cache.resize(30)  # pin budget 15: p1 demoted, and the first to leave
    assert cache.pinned == {("p", 0)} and set(cache.keys()) == {("p", 0), ("p", 2), "a"}
    cache.resize(100)
    assert cache.pin_budget == 50


def test_thread_safety(policy):
    cache = _make(policy, 5000, pinned_keys=list(range(10)))
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(3000):
                key = rng.randrange(200)
                if cache.get(key) is None:
                    cache.put(key, key, rng.randint(10, 100))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.bytes_used <= 5000
    assert cache.stats.hits + cache.stats.misses == 4 * 3000


def test_unknown_policy_and_bad_arguments():
    with pytest.raises(ConfigError):
        make_cache("fifo", 10)
    with pytest.raises(ConfigError):
        make_cache("lru", -1)
    with pytest.raises(ConfigError):
        make_cache("pinned", 10, pinned_fraction=1.5)
    with pytest.raises(ValueError):
        make_cache("lru", 10).put("a", 1, -3)


# ---- eviction order per policy -------------------------------------------------------------


def test_lru_evicts_least_recently_used():
    cache = make_cache("lru", 30)
    for k in "abc":
        cache.put(k, k, 10)
    cache.get("a")  # b is now the oldest
    cache.put("d", "d", 10)
    assert set(cache.keys()) == {"a", "c", "d"}
    cache.peek("c")  # peek does not refresh c
    cache.put("e", "e", 10)
    assert set(cache.keys()) == {"a", "d", "e"}


def test_lfu_evicts_least_frequent_ties_to_lru():
    cache = make_cache("lfu", 30)
    for k in "abc":
        cache.put(k, k, 10)  # an insert counts as one use
    for _ in range(3):
        cache.get("a")
    cache.get("b")  # counts: a=4, b=2, c=1
    cache.put("d", "d", 10)
    assert set(cache.keys()) == {"a", "b", "d"}
    cache.get("d")  # d=2 ties b=2, and b was used less recently
    cache.put("e", "e", 10)
    assert set(cache.keys()) == {"a", "d", "e"}


def test_lfu_counts_survive_eviction():
    cache = make_cache("lfu", 20)
    cache.get("hot")  # a miss is a request too
    cache.put("hot", 1, 10)
    for _ in range(5):
        cache.get("hot")
    assert cache.frequency("hot") == 6
    cache.put("x", 1, 10)
    cache.put("y", 1, 20)  # evicts both
    assert "hot" not in cache
    cache.put("hot", 1, 10)  # comes back with its history
    cache.put("z", 1, 10)
    cache.put("w", 1, 10)  # the victim is the newcomer z, not hot
    assert "hot" in cache and "z" not in cache
    assert cache.frequency("hot") == 6


def test_pinned_keys_never_evicted():
    pins = [("p", i) for i in range(3)]
    cache = make_cache("pinned", 100, pinned_keys=pins, pinned_fraction=0.3)
    for key in pins:
        assert cache.put(key, key, 10)
    assert cache.pinned == frozenset(pins)
    assert cache.pinned_bytes == 30
    for i in range(50):
        cache.put(("x", i), i, 10)
        for key in pins:
            assert key in cache
    assert cache.bytes_used == 100
    # The LRU part is only the unpinned room; a bigger item than that is refused.
    assert not cache.put(("x", "big"), 0, 71)
    assert cache.put(("x", "fits"), 0, 70)
    assert all(key in cache for key in pins)


def test_pinned_budget_and_lru_rest():
    pins = ["h1", "h2", "h3"]
    cache = make_cache("pinned", 100, pinned_keys=pins, pinned_fraction=0.25)
    cache.put("h1", 1, 10)
    cache.put("h2", 1, 10)
    cache.put("h3", 1, 10)  # over the 25-byte pin budget: goes to the LRU part
    assert cache.pinned == {"h1", "h2"}
    for k in "abcdefghij":
        cache.put(k, 1, 10)
    assert "h3" not in cache  # evicted like any LRU item
    assert {"h1", "h2"} <= set(cache.keys())


def test_pinned_hotter_key_demotes_colder():
    pins = ["h1", "h2", "h3"]
    cache = make_cache("pinned", 100, pinned_keys=pins, pinned_fraction=0.2)
    cache.put("h3", 1, 10)
    cache.put("h2", 1, 10)
    assert cache.pinned == {"h2", "h3"}
    cache.put("h1", 1, 10)  # hottest arrives with the budget full: coldest (h3) demoted
    assert cache.pinned == {"h1", "h2"}
    assert "h3" in cache
    for k in "abcdefgh":
        cache.put(k, 1, 10)
    assert "h3" not in cache and {"h1", "h2"} <= set(cache.keys())


def test_pinned_without_pins_is_lru():
    cache = make_cache("pinned", 30)
    for k in "abc":
        cache.put(k, k, 10)
    cache.get("a")
    cache.put("d", "d", 10)
    assert set(cache.keys()) == {"a", "c", "d"}


# ---- tiers --------------------------------------------------------------------------------


class Placed:
    """A value that records which device it was moved to, like a tensor's .device."""

    def __init__(self, payload, device="cpu"):
        self.payload, self.device = payload, device


def _moves():
    log = []

    def to_device(value, device):
        log.append(device)
        return value if value.device == device else Placed(value.payload, device)

    return to_device, log


def test_tiered_put_fills_fast_tier_then_demotes():
    to_device, moves = _moves()
    fast, slow = make_cache("lru", 20), make_cache("lru", 30)
    tiers = TieredCache([("vram", fast, "gpu"), ("ram", slow, "cpu")], to_device=to_device)
    assert tiers.put("a", Placed(1), 10) == "vram"
    assert tiers.peek("a")[1].device == "gpu"
    tiers.put("b", Placed(1), 10)
    tiers.put("c", Placed(1), 10)  # a is demoted to ram, not dropped
    assert tiers.tier_of("a") == "ram" and tiers.tier_of("c") == "vram"
    assert tiers.peek("a")[1].device == "cpu"
    assert len(tiers) == 3 and tiers.demotions == 1
    # Exclusive: a key never sits in two tiers.
    for key in "abc":
        assert (key in fast) + (key in slow) == 1


def test_tiered_get_stats_and_promotion():
    to_device, _ = _moves()
    fast, slow = make_cache("lru", 20), make_cache("lru", 40)
    tiers = TieredCache([("vram", fast, "gpu"), ("ram", slow, "cpu")], to_device=to_device)
    for key in "abcd":
        tiers.put(key, Placed(1), 10)  # vram: c, d; ram: a, b
    assert tiers.tier_of("a") == "ram"
    name, value = tiers.get("a")
    assert name == "ram"  # where it was found
    assert value.device == "gpu"  # handed back from where it now lives
    assert tiers.tier_of("a") == "vram"
    assert tiers.tier_of("c") == "ram"  # the fast tier's LRU item made room
    assert tiers.get("zz") is None
    stats = tiers.stats()
    assert stats["vram"]["hits"] == 0 and stats["vram"]["misses"] == 2
    assert stats["ram"]["hits"] == 1 and stats["ram"]["misses"] == 1
    assert stats["ram"]["hit_rate"] == pytest.approx(0.5)
    assert stats["vram"]["bytes_used"] == 20 and stats["vram"]["capacity_bytes"] == 20
    assert tiers.hits == 1 and tiers.misses == 1 and tiers.promotions == 1
    assert tiers.get("a")[0] == "vram"
    assert tiers.stats()["vram"]["hits"] == 1


def test_tiered_without_promotion_and_with_empty_fast_tier():
    tiers = TieredCache([("vram", make_cache("lru", 0)), ("ram", make_cache("lfu", 50))], promote=False)
    assert tiers.put("a", "A", 10) == "ram"
    assert tiers.get("a") == ("ram", "A")
    assert tiers.tier_of("a") == "ram"
    assert tiers.put("huge", "H", 51) is None
    assert "huge" not in tiers


def test_tiered_put_replaces_across_tiers():
    tiers = TieredCache([("vram", make_cache("lru", 10)), ("ram", make_cache("lru", 100))])
    tiers.put("a", "A", 10)
    tiers.put("b", "B", 10)  # a demoted to ram
    assert tiers.put("a", "A2", 5) == "vram"
    assert tiers.tier_of("a") == "vram" and len(tiers) == 2
    assert tiers.tier("ram").bytes_used + tiers.tier("vram").bytes_used == 15


def test_tiered_rejects_duplicate_names():
    with pytest.raises(ConfigError):
        TieredCache([("ram", make_cache("lru", 1)), ("ram", make_cache("lru", 1))])


# ---- routing histograms ----------------------------------------------------------------------


def test_routing_histogram_round_trip_and_hottest(tmp_path):
    hist = Counter({(0, 3): 2, (0, 1): 1, (2, 7): 1, (2, 3): 1})
    path = tmp_path / "routing.json"
    routing_histogram_save(hist, path)
    data = json.loads(path.read_text())
    assert data["schema"] == ROUTING_SCHEMA
    assert data["counts"] == {"0:1": 1, "0:3": 2, "2:3": 1, "2:7": 1}
    assert routing_histogram_load(path) == hist
    assert hottest_keys(hist) == [(0, 3), (0, 1), (2, 3), (2, 7)]
    assert hottest_keys(hist, 2) == [(0, 3), (0, 1)]
    assert [p.name for p in tmp_path.iterdir()] == ["routing.json"]  # no temp file left


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        '{"schema": "other/1", "counts": {}}',
        '{"schema": "colibri.routing/1", "counts": []}',
        '{"schema": "colibri.routing/1", "counts": {"0-1": 3}}',
        '{"schema": "colibri.routing/1", "counts": {"0:1": -3}}',
        '{"schema": "colibri.routing/1", "counts": {"0:1": 2.5}}',
    ],
)
def test_routing_histogram_rejects_bad_files(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="routing histogram"):
        routing_histogram_load(path)


def test_routing_histogram_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        routing_histogram_load(tmp_path / "none.json")


def test_pinned_from_histogram(tmp_path):
    hist = {(0, 1): 50, (0, 2): 40, (1, 0): 1, (1, 1): 0}
    pins = hottest_keys(hist, 2)
    cache = make_cache("pinned", 100, pinned_keys=pins, pinned_fraction=0.5)
    for key in hist:
        cache.put(key, key, 20)
    assert cache.pinned == {(0, 1), (0, 2)}
