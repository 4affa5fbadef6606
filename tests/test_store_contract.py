"""Conformance suite for the ExpertStore contract, run over every store and every I/O mode.

The model only ever talks to its weights through this contract (engine/movement/store.py), so what is
checked here is what every placement must give it: the exact checkpoint tensors, each asked-for
expert exactly once, reads that never outlive clear_caches, and a budget that holds.
"""

import itertools

import psutil
import pytest
import torch

from engine.format.checkpoint import Checkpoint
from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.format.layout import ExpertLayout
from engine.arch.args import ModelArgs, dense_tensor_names, expert_tensor_names, fused_expert_tensor_names
from engine.arch.registry import model_args
from engine.movement.plan import ACTIVATION_MARGIN, make_plan
from engine.run.runtime import Engine
from engine.movement.store import ExpertStore, LayerStore, ResidentExperts
from engine.movement.streaming_experts import StreamingExperts
from engine.movement.streaming_layers import StreamingLayers
from colibri_hf_models import build

IO_MODES = ("direct", "buffered", "mmap")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("store_moe")
    build("qwen3_moe", d, num_hidden_layers=2, moe_intermediate_size=64, hidden_size=64, mlp_only_layers=[])
    return d


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("store_dense")
    build("llama", d, num_hidden_layers=2, hidden_size=64, intermediate_size=256)
    return d


def _expected_expert(ckpt: Checkpoint, args: ModelArgs, layer: int, e: int):
    """(gate, up, down) straight from the checkpoint, whichever layout it uses."""
    fused = fused_expert_tensor_names(args, layer)
    if fused[0] in ckpt:
        gate_up, down = ckpt.load(fused[0], torch.float32)[e], ckpt.load(fused[1], torch.float32)[e]
        return gate_up[: args.moe_intermediate_size], gate_up[args.moe_intermediate_size:], down
    return tuple(ckpt.load(n, torch.float32) for n in expert_tensor_names(args, layer, e))


def _as_gate_up_down(weights):
    if len(weights) == 3:
        return weights
    gate_up, down = weights
    half = gate_up.shape[0] // 2
    return gate_up[:half], gate_up[half:], down


def _expert_store(kind: str, moe_dir, cache_entries: int = 2, lendable_entries: int = 0):
    ckpt = Checkpoint(moe_dir)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    if kind == "resident":
        return ResidentExperts(layout, torch.float32), ckpt, args
    config = EngineConfig(io_mode=kind, io_threads=2, prefetch_depth=1, ctx_size=64)
    probe = make_plan(ckpt, args, layout, config.replace(ram_budget=1 << 40), torch.float32, torch.float32)
    budget = (probe.dense_bytes + probe.kv_bytes + probe.buffer_bytes + psutil.Process().memory_info().rss
              + ACTIVATION_MARGIN + probe.prefill_bytes + (cache_entries + 0.5) * probe.cache_entry_bytes + (64 << 20))
    plan = make_plan(ckpt, args, layout, config.replace(ram_budget=int(budget)), torch.float32, torch.float32,
                     overhead_bytes=psutil.Process().memory_info().rss + ACTIVATION_MARGIN + (64 << 20))
    assert plan.streaming
    return StreamingExperts(layout, config, plan, torch.float32, lendable_entries * plan.cache_entry_bytes), ckpt, args


EXPERT_STORES = ["resident", *IO_MODES]


@pytest.mark.parametrize("kind", EXPERT_STORES)
def test_each_expert_exactly_once_with_checkpoint_bytes(moe_dir, kind):
    store, ckpt, args = _expert_store(kind, moe_dir)
    try:
        assert isinstance(store, ExpertStore) and store.streams == (kind != "resident")
        for layer, experts in [(0, [0, 3, 5]), (1, [5, 1]), (0, [3, 7, 0, 2])]:  # hits, misses, repeats
            seen = []
            store.for_each_expert(layer, experts, lambda e, w, seen=seen: seen.append((e, _as_gate_up_down(w))))
            assert sorted(e for e, _ in seen) == sorted(experts)
            for e, got in seen:
                for a, b in zip(got, _expected_expert(ckpt, args, layer, e)):
                    assert torch.equal(a, b)
        assert "io_mode_effective" in store.stats()
    finally:
        store.close()
        store.close()  # idempotent


@pytest.mark.parametrize("kind", EXPERT_STORES)
def test_hints_never_change_what_is_delivered(moe_dir, kind):
    store, ckpt, args = _expert_store(kind, moe_dir)
    try:
        for experts, predicted in [([1, 2], [1, 2]), ([3, 4], [4, 6]), ([5, 6], [0, 7])]:  # right, half, wrong
            store.hint_experts(1, predicted)
            seen = {}
            store.for_each_expert(1, experts, lambda e, w: seen.__setitem__(e, _as_gate_up_down(w)))
            assert sorted(seen) == experts
            for e in experts:
                assert all(torch.equal(a, b) for a, b in zip(seen[e], _expected_expert(ckpt, args, 1, e)))
            if kind != "resident":
                # A mispredicted read never outlives its layer: nothing for layer 1 is held now.
                assert not [k for k in list(store.reads) + list(store.ready) if k[0] == 1]
    finally:
        store.close()


@pytest.mark.parametrize("kind", EXPERT_STORES)
def test_in_order_delivers_in_the_order_asked(moe_dir, kind):
    """for_each_expert(in_order=True) calls fn in the order of `experts` whatever is cached, hinted
    (right or wrong) or read on demand, with the checkpoint's bytes, each expert once; a cache of 2
    entries makes landed reads evict what was a hit when looked at."""
    store, ckpt, args = _expert_store(kind, moe_dir)
    try:
        rounds = [(0, [0, 1, 2, 3, 4, 5, 6, 7], None), (0, [1, 3, 4, 6], [6, 7]), (1, [0, 2, 5, 7], [2, 5]),
                  (0, [0, 1, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]), (1, [7, 5, 2, 0], None)]  # the last: descending
        for layer, experts, hinted in rounds:
            if hinted is not None:
                store.hint_experts(layer, hinted)
            seen = []

            def check(e, w, layer=layer, seen=seen):  # at once: holding a slot's views would pin it
                seen.append((e, all(torch.equal(a, b) for a, b in
                                    zip(_as_gate_up_down(w), _expected_expert(ckpt, args, layer, e)))))
            store.for_each_expert(layer, experts, check, in_order=True)
            assert seen == [(e, True) for e in experts]
        if kind != "resident":
            assert store.stats()["slot_overflows"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("kind", EXPERT_STORES)
def test_make_cold_settles_reads_and_rereads_from_disk(moe_dir, kind):
    store, _ckpt, _args = _expert_store(kind, moe_dir)
    try:
        store.for_each_expert(0, [0, 1], lambda e, w: None)
        store.hint_experts(1, [2, 3, 4])
        how = store.make_cold()
        assert isinstance(how, str) and how
        if kind == "resident":
            return
        assert not store.reads and not store.ready and not store.orphans
        assert len(store.cache) == 0
        store.reset_stats()
        store.for_each_expert(0, [0, 1], lambda e, w: None)
        stats = store.stats()
        assert stats["demand_reads"] == 2 and stats["bytes_requested"] == 2 * store.layout.expert_nbytes
        if kind == "mmap":
            assert "madvise" in how
    finally:
        store.close()


@pytest.mark.parametrize("io_mode", ("direct", "buffered"))
def test_slots_bound_every_read_and_cache_entry(moe_dir, io_mode):
    store, _ckpt, args = _expert_store(io_mode, moe_dir, cache_entries=2)
    try:
        plan = store.plan
        assert store.arena.count == plan.arena_slots == plan.max_inflight_experts + plan.cache_slots
        assert store.arena.nbytes == plan.buffer_bytes + plan.cache_bytes  # the plan's figures are the memory
        held = []
        combos = itertools.cycle(itertools.combinations(range(args.num_experts), 2))
        for step in range(60):
            layer = step % args.num_layers
            store.hint_experts((layer + 1) % args.num_layers, list(next(combos)))
            store.for_each_expert(layer, list(next(combos)), lambda e, w: held.append(w[0].data_ptr()))
        stats = store.stats()
        assert stats["slot_overflows"] == 0
        assert 0 < stats["slots_peak"] <= stats["slots"]
        assert all(store.arena.index_of(p) is not None for p in held)  # every read landed in the arena
    finally:
        store.close()


def test_layer_store_contract(dense_dir):
    ckpt = Checkpoint(dense_dir)
    args = model_args(ckpt.config)
    names = {1: [n for n in dense_tensor_names(args) if n.startswith("model.layers.1.")]}
    for io_mode in IO_MODES:
        store = StreamingLayers(ckpt, names, EngineConfig(io_mode=io_mode, io_threads=2), torch.float32)
        try:
            # A layer store is not an expert store: the two contracts share only the lifecycle.
            assert isinstance(store, LayerStore) and not isinstance(store, ExpertStore) and store.streams
            assert not hasattr(store, "for_each_expert")
            store.hint_layer(1)
            for _ in range(2):
                got = store.layer_weights(1)
                assert sorted(got) == sorted(names[1])
                assert all(torch.equal(got[n], ckpt.load(n, torch.float32)) for n in names[1])
            store.hint_layer(1)
            assert store.make_cold() and not store.inflight
            assert store.stats()["demand_reads"] == 1
        finally:
            store.close()
            store.close()


def test_engine_streaming_decode_holds_the_read_budget(moe_dir):
    """Over a long decode with a small cache: never more than max_inflight reads held, no slot
    overflow, nothing left in flight between tokens, and tokens equal to the resident run."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with Engine(moe_dir, EngineConfig(threads=1, ctx_size=128)) as engine:
        reference = generate(engine, prompt, 40, Sampler()).output_ids
    store, *_ = _expert_store("direct", moe_dir, cache_entries=2)
    budget = store.plan.budget
    store.close()
    config = EngineConfig(threads=1, ctx_size=128, io_mode="direct", io_threads=2, prefetch_depth=1, ram_budget=budget)
    with Engine(moe_dir, config) as engine:
        s = engine.store
        seen_outstanding = []
        original = s._submit

        def counting_submit(key, prefetch):
            seen_outstanding.append(len(s.reads) + len(s.ready) + len(s.orphans) + 1)
            return original(key, prefetch)

        s._submit = counting_submit
        between = []
        tokens = generate(engine, prompt, 40, Sampler(),
                          on_token=lambda _t: between.append(len(s.reads) + len(s.ready))).output_ids
        stats = engine.io_stats()
    assert tokens == reference
    assert max(seen_outstanding) <= s.max_inflight
    assert stats["slot_overflows"] == 0 and stats["slots_peak"] <= stats["slots"]
    assert set(between) == {0}


def _mapped_rss(mappings) -> int:
    """Resident bytes of these mmap objects in this process (/proc/self/smaps)."""
    import numpy as np
    starts = {np.frombuffer(m, dtype=np.uint8).ctypes.data for m in mappings}
    total, current = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                current = int(fields[0].split("-")[0], 16) in starts
            elif fields and fields[0] == "Rss:" and current:
                total += int(fields[1]) * 1024
    return total


def test_mmap_make_cold_unmaps_resident_pages(moe_dir):
    store, _ckpt, _args = _expert_store("mmap", moe_dir)
    try:
        store.for_each_expert(0, [0, 1, 2, 3], lambda e, w: None)
        mappings = store.pool.files.mappings()
        assert _mapped_rss(mappings) > 0  # fault-in made the experts' pages resident in this process
        how = store.make_cold()
        assert _mapped_rss(mappings) == 0 and "madvise" in how
    finally:
        store.close()


def test_mmap_int4_strips_release_the_mapped_pages_they_were_copied_from(tmp_path):
    """mmap maps the files read-only, so an int4 expert is repacked into strips in new memory; the
    pages it was copied from are released then (StreamingExperts._value, pool.drop_range), else the
    memory cgroup would hold every cached expert twice. Whole pages inside each read expert's span
    leave this process: less than one expert's bytes stay mapped after four were read (the pages a
    neighbour shares, and what the kernel's fault-around mapped of experts not read)."""
    from engine.format.convert import convert
    from engine.weights.quantized import int4_strips_on
    if not int4_strips_on():
        pytest.skip("int4 strips need engine/native's int kernels (VNNI/VBMI)")
    src = tmp_path / "src"
    build("qwen3_moe", src, num_hidden_layers=2, moe_intermediate_size=256, hidden_size=256, mlp_only_layers=[])
    out = convert(src, tmp_path / "int4", "int4", group_size=32)["path"]
    store, _ckpt, _args = _expert_store("mmap", out)
    try:
        seen = []
        store.for_each_expert(0, [0, 1, 2, 3], lambda e, w: seen.append(all(getattr(m, "strips", False) for m in w)))
        assert seen == [True] * 4
        page = __import__("mmap").PAGESIZE
        span = store.layout.location(0, 0).spans[0].length
        assert span >= 16 * page  # so a release that did not happen would show
        assert _mapped_rss(store.pool.files.mappings()) < span
    finally:
        store.close()


def test_a_repaid_loan_takes_back_the_lent_slots_and_no_kept_one(moe_dir):
    """A drafter's idle bytes lent to the cache as spare slots: reads land in them and the cache keeps
    those experts; repaying evicts exactly those (and the least wanted, if fewer) and takes the lent
    slots back, so afterwards every cached expert and every read lies in the kept mapping, whose huge
    pages a dropped slot would have split (engine/movement/slots.py), and nothing overflowed."""
    store, ckpt, args = _expert_store("direct", moe_dir, cache_entries=4, lendable_entries=3)
    try:
        plan, ram, arena = store.plan, store.cache.tier("ram"), store.arena
        # lent from the start: the cache and the arena hold the loan before anything drafted
        assert store.borrowable == store.borrowed == 3 and arena.withheld == 0
        assert arena.count == plan.arena_slots + 3 and ram.capacity_bytes == plan.cache_bytes + 3 * plan.cache_entry_bytes
        assert store.borrow() == 0  # (open already)
        combos = itertools.cycle(itertools.combinations(range(args.num_experts), 3))
        for step in range(40):  # more experts than the cache holds: slots cycle, the lent ones among them
            store.for_each_expert(step % args.num_layers, list(next(combos)), lambda e, w: None)
        in_lent = [k for k in arena.lent_owners() if k in ram]
        assert in_lent  # cached experts in lent slots: what the repay must evict
        store.repay()
        assert arena.withheld == 3 and arena.count == plan.arena_slots and store.slot_overflows == 0
        assert not any(k in ram for k in in_lent) and ram.capacity_bytes == plan.cache_bytes
        cached = [ram.peek(k)[0].data_ptr() for k in ram.keys()]
        assert cached and all(arena.index_of(p) < plan.arena_slots for p in cached)
        landed = []
        for step in range(12):
            store.for_each_expert(step % args.num_layers, list(next(combos)),
                                  lambda e, w: landed.append(w[0].data_ptr()))
        assert all(arena.index_of(p) < plan.arena_slots for p in landed)
        assert store.borrow() == 3 and arena.count == plan.arena_slots + 3 and arena.withheld == 0  # lent again
    finally:
        store.close()
