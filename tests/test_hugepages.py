"""Resident weights in huge-page arenas (engine/base/hugepages.py): private (not shmem) memory
that asks for THP, pieces of one storage, and an engine whose weights all live there."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.weights.stored import StoredMatrix
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from test_streaming import budget_for_cache
from colibri_native_cases import PROMPT, bf16_model  # noqa: F401 (fixture)
from engine.base.hugepages import HUGE_PAGE, PIECE_ALIGN, HugePageArena, arena_bytes, mapping_huge_bytes, thp_mode


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


def test_allocator_pieces_share_one_storage_and_fall_back_past_the_end():
    arena = HugePageArena(arena_bytes([128, 64]))
    alloc = arena.allocator()
    a, b = alloc(128), alloc(64)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == arena.address
    assert b.storage_offset() == 128 and a.data_ptr() % PIECE_ALIGN == 0
    c = alloc(1 << 20)  # past the end: a plain tensor, not an error
    assert c.numel() == 1 << 20 and not arena.address <= c.data_ptr() < arena.address + arena.nbytes
    assert HugePageArena(0).allocator()(16).numel() == 16


def test_adjacent_rows_views_back_to_back_parts_and_refuses_the_rest():
    from engine.arch.model import _adjacent_rows

    whole = torch.arange(24, dtype=torch.float32)
    q, k, v = whole[:12].view(3, 4), whole[12:16].view(1, 4), whole[16:24].view(2, 4)
    fused = _adjacent_rows([q, k, v])
    assert fused.shape == (6, 4) and torch.equal(fused, torch.cat([q, k, v]))
    assert fused.data_ptr() == q.data_ptr()  # a view: no copy
    assert _adjacent_rows([q, v]) is None  # a gap between them
    assert _adjacent_rows([q, torch.zeros(1, 4)]) is None  # another storage
    assert _adjacent_rows([k, q]) is None  # out of order


def test_checkpoint_load_into_an_allocator_reads_and_casts_there(bf16_model):
    from engine.format.checkpoint import Checkpoint

    ckpt = Checkpoint(bf16_model)
    name = "model.embed_tokens.weight"
    arena = HugePageArena(4 * ckpt.info(name).nbytes)
    alloc = arena.allocator()
    same, cast = ckpt.load(name, torch.bfloat16, alloc), ckpt.load(name, torch.float32, alloc)
    assert torch.equal(same, ckpt.load(name)) and torch.equal(cast, ckpt.load(name).float())
    assert all(arena.address <= t.data_ptr() < arena.address + arena.nbytes for t in (same, cast))


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
        assert dense and all(_inside(engine.dense_arena, t) for t in dense)
        head = net.lm_head if type(net.lm_head) is torch.Tensor else net.lm_head.qweight
        assert _inside(engine.dense_arena, head)
        if not quant:  # the fused q/k/v is a view of the three, not a copy
            assert net._qkv and all(_inside(engine.dense_arena, t) for t in net._qkv.values())
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


def test_a_withhold_marks_the_huge_page_kept_and_spare_slots_share_not_huge():
    """Spare slots lent from the start lie in the kept slots' mapping under huge-page advice. Once a
    withhold has dropped their pages, khugepaged must not fill them in again (a huge page there would hold
    the bytes the loan gave back): from the huge page the kept and the spare slots share to the end the
    mapping is MADV_NOHUGEPAGE ("nh"), while the kept slots' whole huge pages before it keep the advice."""
    from engine.movement.slots import SlotArena

    slot = 3 * 4096 * 25  # 300 KiB: the twelve kept slots end inside the second huge page
    arena = SlotArena(slot, 12, spare=7, lent=True)
    leases = [arena.acquire() for _ in range(19)]
    at = {arena.index_of(ctypes.addressof(lease)): ctypes.addressof(lease) for lease in leases}
    del leases
    first_page, shared_page = at[0], at[12] // HUGE_PAGE * HUGE_PAGE

    def flags(address: int) -> list[str]:
        return _vma(address)[1].get("VmFlags", "").split()

    if "hg" not in flags(first_page):
        pytest.skip("the kernel took no huge-page advice (THP not built in)")
    assert "hg" in flags(shared_page) and "nh" not in flags(shared_page)  # lent: advised as kept slots
    assert arena.withhold(7) == 7
    assert "nh" in flags(shared_page) and "nh" in flags(at[18])
    assert "hg" in flags(first_page) and shared_page > first_page


def test_lending_every_spare_slot_again_gives_back_the_huge_page_a_withhold_split():
    """A drafter's trial takes its memory back from the cache (withhold) and lends it again after: the
    arena must then hold as many huge pages as before the trial, not one fewer for the rest of the run
    (the split one collapsed back), and the cached bytes in that page must survive the collapse."""
    from engine.movement.slots import SlotArena

    slot = 3 * 4096 * 25  # 300 KiB: the twelve kept slots end inside the second huge page
    arena = SlotArena(slot, 12, spare=7, lent=True)
    before = arena.huge_bytes()
    if not before:
        pytest.skip("no huge pages here (THP not built in or not granted)")
    leases = [arena.acquire() for _ in range(12)]  # the kept ones, handed out first in order
    shared = next(lease for lease in leases if arena.index_of(ctypes.addressof(lease)) == 11)
    ctypes.memset(ctypes.addressof(shared), 0x5A, slot)
    assert arena.withhold(7) == 7
    assert arena.huge_bytes() == before - HUGE_PAGE  # split by the dropped pages
    assert arena.lend(7) == 7
    if arena.huge_bytes() != before and not _collapses():
        pytest.skip("the kernel cannot collapse a range (MADV_COLLAPSE, Linux >= 6.1)")
    assert arena.huge_bytes() == before
    assert bytes(shared) == b"\x5a" * slot
    assert "nh" not in _vma(ctypes.addressof(shared))[1].get("VmFlags", "").split()


def _collapses() -> bool:
    """Whether this kernel takes MADV_COLLAPSE on a private anonymous huge page."""
    import mmap

    m = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-ctypes.addressof(ctypes.c_char.from_buffer(m))) % HUGE_PAGE
    m[start:start + 1] = b"x"
    try:
        m.madvise(getattr(mmap, "MADV_COLLAPSE", 25), start, HUGE_PAGE)
        return True
    except OSError:
        return False
    finally:
        m.close()
