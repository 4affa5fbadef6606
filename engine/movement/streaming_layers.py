"""StreamingLayers: a dense model's layers read from disk per forward pass, ahead of use
(the read pool, counters and read figures: reading_store.py, shared with StreamingExperts)."""

from __future__ import annotations

import time
from concurrent.futures import Future, wait

import torch

from engine.base.config import EngineConfig
from engine.format.layout import group_into_spans, piece_tensor
from engine.movement.reading_store import ReadingStore
from engine.movement.store import LayerStore


class StreamingLayers(ReadingStore, LayerStore):
    """Layer streaming for dense models: a layer's tensors are read per token, ahead of use."""

    def __init__(self, checkpoint, names_by_layer: dict[int, list[str]], config: EngineConfig, dtype: torch.dtype):
        self.dtype = dtype
        self.open_reads(config)
        self.layers: dict[int, tuple[list, list]] = {}
        for layer, names in names_by_layer.items():
            spans, pieces = group_into_spans([checkpoint.info(n) for n in names])
            self.layers[layer] = (spans, list(zip(names, pieces)))
        self.inflight: dict[int, list[Future]] = {}
        self.reset_stats()

    def hint_layer(self, layer: int) -> None:
        if layer not in self.inflight:
            spans = self.layers[layer][0]
            self.inflight[layer] = [self.pool.submit(s.path, s.offset, s.length) for s in spans]
            if self.tracer is not None:
                for s, f in zip(spans, self.inflight[layer]):
                    self.tracer.submitted(s.path, s.offset, s.length, layer, f)
            self.prefetch_reads += 1

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self.inflight:
            self.demand_reads += 1
            self.hint_layer(layer)
            self.prefetch_reads -= 1
        t0 = time.perf_counter()
        buffers = [f.result() for f in self.inflight.pop(layer)]
        self.stall_seconds += time.perf_counter() - t0
        return {name: piece_tensor(buffers, piece, self.dtype) for name, piece in self.layers[layer][1]}

    def clear_caches(self) -> None:
        """Streamed layers are never cached; reads in flight are cancelled or waited for."""
        for futures in self.inflight.values():
            for f in futures:
                f.cancel()
        wait([f for fs in self.inflight.values() for f in fs])
        self.inflight.clear()

    def make_cold(self) -> str:
        self.clear_caches()
        return "in-flight layer reads settled; " + self.drop_pages(
            [s.path for spans, _ in self.layers.values() for s in spans])

    def reset_stats(self) -> None:
        self.reset_window()
        self.demand_reads = self.prefetch_reads = 0

    def stats(self) -> dict:
        return {
            **self.read_figures(),
            "hit_rate": {}, "demand_reads": self.demand_reads, "prefetch_reads": self.prefetch_reads,
            "streamed_layers": len(self.layers), "lookahead_recall": None,
        }
