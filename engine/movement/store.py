"""The store contracts: what the model asks of the weights it does not hold itself.

Two contracts on one lifecycle (`WeightStore`), since a store either holds routed experts or
streams a dense model's layers, never both:

    ExpertStore   routed experts by (layer, expert)
        ResidentExperts    every routed expert in RAM (here): the reference placement
        StreamingExperts   read from disk into slots and tiered caches (streaming_experts.py)
    LayerStore    a dense model's layers by name
        StreamingLayers    read per forward pass, ahead of use (streaming_layers.py)

The conformance suite (tests/test_store_contract.py) runs over every one of them.

What the model calls of an ExpertStore:
    for_each_expert(layer, experts, fn)   call fn(expert, weights) once per expert, in the
                                          order the weights become available (hits first,
                                          then reads as they land); the caller sums in a
                                          fixed order, so the order here never shows.
        ... in_order=True                 in the order of `experts` instead (a read that
                                          lands early waits in its slot): a layer-major
                                          prefill adds each expert's rows into the group's
                                          output as it goes, in ascending expert order.
    hint_experts(layer, experts)          a later layer will probably need these.
    resident(layer, experts)              their weights if all are held in RAM for good
                                          (ResidentExperts), else None: the decode step may
                                          then batch them into one call.
of a LayerStore:
    layer_weights(layer) / hint_layer(layer)   a layer's tensors by name; read ahead.

What the runtime and bench call of either (WeightStore):
    streams           whether a disk is in the loop (bench makes those cold; io stats exist)
    clear_caches()    forget every cached weight; reads in flight are waited for or cancelled
    make_cold()       clear_caches() + drop the weights' pages; returns how cold was achieved
    reset_stats(), stats(), close()

`weights` is whatever the layout's decode step made of the bytes (today
layout.tensors_from_buffers: (gate_up [2I,H], down [H,I]) in the compute dtype); the model's
expert function is the one thing that reads it, so a new container format replaces both.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from engine.base.errors import ModelFormatError
from engine.base.hugepages import HugePageArena, arena_bytes
from engine.format.layout import ExpertLayout, tensors_from_buffers

ExpertFn = Callable[[int, tuple], None]


class WeightStore(ABC):
    """The lifecycle every store shares: the runtime and bench call these, never the model."""

    streams: bool = False

    def clear_caches(self) -> None:
        """Default: nothing cached."""

    def make_cold(self) -> str:
        """Empty the caches and drop the weights' pages; the answer says what was done."""
        self.clear_caches()
        return "resident: nothing to make cold"

    def reset_stats(self) -> None:
        """Default: no counters."""

    @abstractmethod
    def stats(self) -> dict: ...

    def close(self) -> None:
        """Default: nothing to release."""


class ExpertStore(WeightStore):
    """Routed experts by (layer, expert): what the MoE layers ask for."""

    # Experts handed out by for_each_expert since load, never reset: a batched decode step fetches
    # the union of its rows' experts once per layer (engine/arch/decode_rows.py), so the scheduler
    # reads that union as this count's change over the step (engine/run/batch.py).
    fetched: int = 0

    @abstractmethod
    def for_each_expert(self, layer: int, experts: list[int], fn: ExpertFn, in_order: bool = False) -> None: ...

    def hint_experts(self, layer: int, experts: list[int]) -> None:
        """Default: nothing to read ahead."""

    def resident(self, layer: int, experts: list[int]) -> list[tuple] | None:
        """These experts' weights, in this order, if all are in RAM for good (no read, no cache
        bookkeeping): the model may then compute them in one batched call. Default: None."""
        return None


class LayerStore(WeightStore):
    """A dense model's layers by name: what a streamed dense layer asks for."""

    @abstractmethod
    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]: ...

    def hint_layer(self, layer: int) -> None:
        """Default: nothing to read ahead."""


class ResidentExperts(ExpertStore):
    """Every routed expert loaded once into RAM, all of them in one arena that asks for huge
    pages (engine/base/hugepages.py): decode streams them through the TLB once a token."""

    def __init__(self, layout: ExpertLayout, dtype: torch.dtype):
        self._experts = {}
        locations = {key: layout.location(*key) for key in layout.keys()}
        self.arena = HugePageArena(arena_bytes(s.length for loc in locations.values() for s in loc.spans))
        for key, loc in locations.items():
            buffers = [read_span(s, self.arena.take(s.length)) for s in loc.spans]
            self._experts[key] = tensors_from_buffers(loc, buffers, dtype)

    def for_each_expert(self, layer, experts, fn, in_order=False):
        self.fetched += len(experts)
        for e in experts:  # in the order asked: in_order or not
            fn(e, self._experts[(layer, e)])

    def resident(self, layer, experts):
        return [self._experts[(layer, e)] for e in experts]

    def stats(self) -> dict:
        return {"io_mode_effective": "resident", "expert_lookups": None}


def read_span(span, buf=None):
    """The span's bytes, into `buf` (a writable buffer of span.length bytes) or a new bytearray."""
    buf = bytearray(span.length) if buf is None else buf
    with open(span.path, "rb", buffering=0) as f:
        if os.preadv(f.fileno(), [buf], span.offset) != span.length:
            raise ModelFormatError(f"{span.path}: truncated (expert bytes at {span.offset} missing)")
    return buf
