"""The expert store: routed experts streamed from disk into tiered caches, with read-ahead.

    get(layer, experts)   the compute needs these now: cache hits are free, reads already in
                          flight (issued by a hint) are waited for, the rest are read now.
    hint(layer, experts)  router lookahead predicted these for a later layer: start reading.

Everything here runs on the compute thread except the reads themselves (ReadPool workers),
so the caches need no cross-thread care beyond what they already have.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait

import torch

from .cache import TieredCache, hottest_keys, make_cache, routing_histogram_load
from .config import EngineConfig
from .io import IOStats, ReadPool
from .layout import ExpertLayout, group_into_spans, piece_tensor, tensors_from_buffers
from .plan import MemoryPlan

# Share of the RAM cache the pinned policy reserves for the recorded hottest experts.
PINNED_FRACTION = 0.5


def _to_device(value, device: str):
    return tuple(t.to(device, non_blocking=False) for t in value)


class StreamingExperts:
    def __init__(self, layout: ExpertLayout, config: EngineConfig, plan: MemoryPlan, dtype: torch.dtype):
        self.layout = layout
        self.dtype = dtype
        self.plan = plan
        self.io_stats = IOStats()
        self.pool = ReadPool(config.io_mode, config.io_threads, config.chunk_size, stats=self.io_stats)
        pinned = []
        if config.cache_policy == "pinned" and config.routing_histogram:
            pinned = hottest_keys(routing_histogram_load(config.routing_histogram))
        tiers = []
        if plan.gpu_cache_bytes:
            tiers.append(("vram", make_cache("lru", plan.gpu_cache_bytes), "cuda"))
        tiers.append(("ram", make_cache(config.cache_policy, plan.cache_bytes, pinned_keys=pinned,
                                          pinned_fraction=PINNED_FRACTION), "cpu"))
        self.cache = TieredCache(tiers, to_device=_to_device)
        self.max_inflight = max(plan.max_inflight_experts, 1)
        self.inflight: dict[tuple[int, int], list[Future]] = {}
        self.ready: dict[tuple[int, int], tuple] = {}  # finished lookahead reads, not yet used
        self.predicted: dict[int, set[int]] = {}
        self.reset_stats()
        if pinned:
            self._preload(pinned)

    # --- the ExpertSource contract ---------------------------------------------------------

    def get(self, layer: int, experts: list[int]):
        out, pending = {}, []
        for e in experts:
            key = (layer, e)
            self.lookups += 1
            if key in self.ready:  # lookahead read it in time
                out[e] = self._keep(key, self.ready.pop(key))
                self.prefetched_used += 1
                continue
            hit = self.cache.get(key)
            if hit is not None:
                tier, out[e] = hit
                self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1
                continue
            if key in self.inflight:
                self.prefetched_used += 1
            else:
                self.demand_reads += 1
                self.inflight[key] = self._submit(key)
            pending.append(key)
        if pending:
            t0 = time.perf_counter()
            wait([f for key in pending for f in self.inflight[key]])
            self.stall_seconds += time.perf_counter() - t0
            for key in pending:
                out[key[1]] = self._keep(key, self._finish(key))
        # Mispredicted reads for this layer: no longer ahead of anything; the cache may keep them.
        for key in [k for k in self.ready if k[0] == layer]:
            self._keep(key, self.ready.pop(key))
        predicted = self.predicted.get(layer)
        if predicted is not None:
            self.recall_hits += len(predicted.intersection(experts))
            self.recall_total += len(experts)
        self._collect_done()
        return out

    def hint(self, layer: int, experts: list[int]) -> None:
        self.predicted[layer] = set(experts)
        for e in experts:
            key = (layer, e)
            if key in self.inflight or key in self.ready or key in self.cache:
                continue
            if len(self.inflight) + len(self.ready) >= self.max_inflight:
                return  # read buffers are budgeted: never more than max_inflight held
            self.inflight[key] = self._submit(key)
            self.prefetch_reads += 1

    # --- reads -----------------------------------------------------------------------------

    def _submit(self, key) -> list[Future]:
        loc = self.layout.location(*key)
        return [self.pool.submit(s.path, s.offset, s.length) for s in loc.spans]

    def _finish(self, key):
        """The read of `key` as tensors in the compute dtype (waits if still in flight)."""
        futures = self.inflight.pop(key)
        buffers = [f.result() for f in futures]  # re-raises a read error (e.g. truncated shard)
        return tensors_from_buffers(self.layout.location(*key), buffers, self.dtype)

    def _keep(self, key, value):
        """Offer a used (or given-up) expert to the cache; compute where it ends up living."""
        if self.cache.put(key, value, self.plan.expert_bytes) == "vram":
            value = self.cache.peek(key)[1]
        return value

    def _collect_done(self) -> None:
        # Finished lookahead reads wait in `ready` (part of the read-buffer budget, not the
        # cache) until their layer asks, so they help even with a zero-size cache.
        for key in [k for k, fs in self.inflight.items() if all(f.done() for f in fs)]:
            self.ready[key] = self._finish(key)

    def _preload(self, keys) -> None:
        """Read the pinned experts up front, as many as the pinned share of the cache holds."""
        room = int(self.plan.cache_bytes * PINNED_FRACTION) // max(self.plan.expert_bytes, 1)
        known = self.layout.keys()
        keys = [k for k in keys if k in known][:room]
        for start in range(0, len(keys), self.max_inflight):
            batch = keys[start:start + self.max_inflight]
            for key in batch:
                self.inflight[key] = self._submit(key)
            for key in batch:
                self._keep(key, self._finish(key))

    # --- measurement -----------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.io_stats.reset()
        self.stall_seconds = 0.0
        self.recall_hits = self.recall_total = 0
        self.demand_reads = self.prefetch_reads = self.prefetched_used = 0
        self.lookups = 0
        self.tier_hits: dict[str, int] = {}
        self._window_start = time.perf_counter()

    def clear_caches(self) -> None:
        """Forget every cached expert (a cold start); reads in flight are left to finish."""
        for name in self.cache.tier_names:
            self.cache.tier(name).clear()
        self.ready.clear()

    def drop_page_cache(self) -> None:
        for path in {s.path for key in self.layout.keys() for s in self.layout.location(*key).spans}:
            self.pool.drop_page_cache(path)

    def stats(self) -> dict:
        """Counters since reset_stats(). Every expert lookup is exactly one of: a hit in a cache
        tier (kept from an earlier use), a prefetch that lookahead issued in time or in flight,
        or a demand read; the three rates add up to 1."""
        window = time.perf_counter() - self._window_start
        io = self.io_stats.snapshot()
        n = self.lookups
        return {
            "io_mode_effective": self.pool.effective_mode,
            "bytes_read": io["bytes_read"],
            "bytes_requested": io["bytes_requested"],
            "read_requests": io["requests"],
            "read_gbps": io["bytes_read"] / window / 1e9 if window > 0 else None,
            "expert_lookups": n,
            "hit_rate": {name: (self.tier_hits.get(name, 0) / n if n else None) for name in self.cache.tier_names},
            "prefetch_coverage": self.prefetched_used / n if n else None,
            "demand_read_rate": self.demand_reads / n if n else None,
            "cache_items": {name: s["items"] for name, s in self.cache.stats().items()},
            "demand_reads": self.demand_reads,
            "prefetch_reads": self.prefetch_reads,
            "prefetched_used": self.prefetched_used,
            "lookahead_recall": self.recall_hits / self.recall_total if self.recall_total else None,
            "io_stall_s": self.stall_seconds,
            "io_stall_fraction": self.stall_seconds / window if window > 0 else None,
        }

    def close(self) -> None:
        for futures in self.inflight.values():
            for f in futures:
                f.cancel()
        wait([f for fs in self.inflight.values() for f in fs])
        self.inflight.clear()
        self.ready.clear()
        self.pool.close()


class StreamingLayers:
    """Layer streaming for dense models: a layer's tensors are read per token, ahead of use."""

    def __init__(self, checkpoint, names_by_layer: dict[int, list[str]], config: EngineConfig, dtype: torch.dtype):
        self.dtype = dtype
        self.io_stats = IOStats()
        self.pool = ReadPool(config.io_mode, config.io_threads, config.chunk_size, stats=self.io_stats)
        self.layers: dict[int, tuple[list, list]] = {}
        for layer, names in names_by_layer.items():
            spans, pieces = group_into_spans([checkpoint.info(n) for n in names])
            self.layers[layer] = (spans, list(zip(names, pieces)))
        self.inflight: dict[int, list[Future]] = {}
        self.reset_stats()

    def clear_caches(self) -> None:
        pass  # streamed layers are never cached

    def hint(self, layer: int) -> None:
        if layer not in self.inflight:
            self.inflight[layer] = [self.pool.submit(s.path, s.offset, s.length) for s in self.layers[layer][0]]
            self.prefetch_reads += 1

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self.inflight:
            self.demand_reads += 1
            self.hint(layer)
            self.prefetch_reads -= 1
        t0 = time.perf_counter()
        buffers = [f.result() for f in self.inflight.pop(layer)]
        self.stall_seconds += time.perf_counter() - t0
        return {name: piece_tensor(buffers, piece, self.dtype) for name, piece in self.layers[layer][1]}

    def reset_stats(self) -> None:
        self.io_stats.reset()
        self.stall_seconds = 0.0
        self.demand_reads = self.prefetch_reads = 0
        self._window_start = time.perf_counter()

    def drop_page_cache(self) -> None:
        for spans, _ in self.layers.values():
            for s in spans:
                self.pool.drop_page_cache(s.path)

    def stats(self) -> dict:
        window = time.perf_counter() - self._window_start
        io = self.io_stats.snapshot()
        return {
            "io_mode_effective": self.pool.effective_mode,
            "bytes_read": io["bytes_read"], "bytes_requested": io["bytes_requested"],
            "read_requests": io["requests"],
            "read_gbps": io["bytes_read"] / window / 1e9 if window > 0 else None,
            "hit_rate": {}, "demand_reads": self.demand_reads, "prefetch_reads": self.prefetch_reads,
            "streamed_layers": len(self.layers), "lookahead_recall": None,
            "io_stall_s": self.stall_seconds,
            "io_stall_fraction": self.stall_seconds / window if window > 0 else None,
        }

    def close(self) -> None:
        wait([f for fs in self.inflight.values() for f in fs])
        self.inflight.clear()
        self.pool.close()
