"""Resident weights in one huge-page arena (engine/base/hugepages.py): same bytes, same views,
private (not shmem) memory that asks for THP, and an engine whose weights all live there."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.format.quant import StoredMatrix
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from test_streaming import budget_for_cache
from colibri_native_cases import PROMPT, bf16_model  # noqa: F401 (fixture)
from engine.base.hugepages import (HUGE_PAGE, PIECE_ALIGN, HugePageArena, arena_bytes, mapping_huge_bytes,
                                   rehome, thp_mode)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _vma(address: int) -> tuple[str, dict[str, str]]:
    """(permissions, fields) of the /proc/self/smaps entry holding `address`."""
    perms, fields, inside = "", {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                break
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
            perms = line.split()[1]
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return perms, fields


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]", "never"), ("garbage", "unavailable")])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode


def test_thp_mode_without_the_file_is_unavailable(tmp_path):
    assert thp_mode(tmp_path / "missing") == "unavailable"


def test_arena_pieces_are_aligned_distinct_and_bounded():
    arena = HugePageArena(arena_bytes([100, 5000, 1]))
    assert arena.address % HUGE_PAGE == 0
    a, b, c = arena.take(100), arena.take(5000), arena.take(1)
    starts = [_address(v) for v in (a, b, c)]
    assert all(s % PIECE_ALIGN == 0 for s in starts)
    assert starts[0] + 100 <= starts[1] and starts[1] + 5000 <= starts[2]
    b[:] = bytes(range(256)) * 19 + bytes(136)
    assert bytes(b[:3]) == b"\x00\x01\x02" and bytes(a) == bytes(100)
    with pytest.raises(MemoryError):
        arena.take(PIECE_ALIGN)


def test_arena_is_private_memory_that_asks_for_huge_pages():
    """Python's anonymous mmap is MAP_SHARED (shmem), which ignores MADV_HUGEPAGE: the arena must be
    a private mapping, and where THP is on, the kernel must see the advice (THPeligible)."""
    arena = HugePageArena(4 * HUGE_PAGE)
    view = arena.take(4 * HUGE_PAGE)
    view[::4096] = b"\x01" * len(range(0, 4 * HUGE_PAGE, 4096))
    perms, fields = _vma(arena.address)
    assert perms.endswith("p"), perms
    if thp_mode() in ("always", "madvise") and "THPeligible" in fields:
        assert arena.advised and fields["THPeligible"] == "1"
    huge = arena.huge_bytes()
    assert huge is not None and 0 <= huge <= 5 * HUGE_PAGE


def test_mapping_huge_bytes_of_an_unmapped_address_or_unreadable_smaps(tmp_path):
    assert mapping_huge_bytes(0) is None
    assert mapping_huge_bytes(1 << 20, tmp_path / "missing") is None


def test_rehome_keeps_values_views_ties_and_other_objects():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(12, 8, generator=g).to(torch.bfloat16)
    q, k, v = fused.split([6, 3, 3])
    embed = torch.randn(5, 8, generator=g)
    marker = object()
    tensors = {"fused": fused, "q": q, "k": k, "v": v, "embed": embed, "head": embed, "t": fused.t(),
               "other": marker, "none": None, "empty": torch.empty(0)}
    expected = {key: t.clone() for key, t in tensors.items() if type(t) is torch.Tensor}
    old_ptrs = {fused.untyped_storage().data_ptr(), embed.untyped_storage().data_ptr()}
    del fused, q, k, v, embed
    arena = rehome(tensors)
    assert arena is not None
    for key, want in expected.items():
        assert torch.equal(tensors[key], want) and tensors[key].dtype == want.dtype, key
        assert tensors[key].shape == want.shape and tensors[key].stride() == want.stride(), key
    moved = {tensors[key].untyped_storage().data_ptr() for key in ("fused", "embed")}
    assert not moved & old_ptrs
    assert all(arena.address <= p < arena.address + arena.nbytes for p in moved)
    # the views are still views: one write shows through every tensor over the same bytes
    assert tensors["q"].untyped_storage().data_ptr() == tensors["fused"].untyped_storage().data_ptr()
    tensors["fused"][0, 0] = 7.0
    assert tensors["q"][0, 0].item() == 7.0 and tensors["t"][0, 0].item() == 7.0
    tensors["embed"][1, 2] = -3.0
    assert tensors["head"][1, 2].item() == -3.0
    assert tensors["other"] is marker and tensors["none"] is None


def test_rehome_with_nothing_to_move():
    marker = object()
    assert rehome({"a": marker, "b": None}) is None


def _inside(arena: HugePageArena, t: torch.Tensor) -> bool:
    return arena.address <= t.untyped_storage().data_ptr() < arena.address + arena.nbytes


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a_resident_engine_holds_every_weight_in_its_arenas(bf16_model, tmp_path, quant):
    """Every routed expert in the experts' arena and every dense tensor (int8 codes and scales
    included) in the dense one, with the tokens of a streaming run (whose experts are read into
    slots, not the arena)."""
    model = bf16_model
    if quant:
        model = tmp_path / "q"
        convert(bf16_model, model, quant=quant, scope="all")
    config = EngineConfig(ram_budget=0, threads=1, ctx_size=64)
    with Engine(model, config) as engine:
        store, net = engine.experts, engine.model
        assert store._experts
        for key, weights in store._experts.items():
            for t in weights:
                codes = t if type(t) is torch.Tensor else getattr(t, t.tensor_fields[0])
                assert _inside(store.arena, codes), key
        dense = [t for t in net.w.values() if type(t) is torch.Tensor]
        dense += [getattr(m, f) for m in net.w.values() if isinstance(m, StoredMatrix) for f in m.tensor_fields]
        assert dense and all(_inside(net.dense_arena, t) for t in dense)
        assert _inside(net.dense_arena, net.lm_head if type(net.lm_head) is torch.Tensor else net.lm_head.qweight)
        assert any(isinstance(m, StoredMatrix) for m in net.w.values()) == bool(quant)
        reference = generate(engine, PROMPT, 6, Sampler()).output_ids
    config = config.replace(ram_budget=budget_for_cache(model, config, cache_experts=3))
    with Engine(model, config) as engine:
        assert engine.plan.streaming
        assert generate(engine, PROMPT, 6, Sampler()).output_ids == reference


def test_the_streaming_slot_arena_is_private_memory_too():
    """The slot arena asked for huge pages over a MAP_SHARED (shmem) mapping, where the advice is
    ignored; it must be private for the cached experts to get them."""
    from engine.movement.slots import SlotArena

    arena = SlotArena(HUGE_PAGE, 2)
    lease = arena.acquire()
    perms, _ = _vma(ctypes.addressof(lease))
    assert perms.endswith("p"), perms
