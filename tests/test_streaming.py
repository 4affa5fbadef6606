"""Streaming under a memory budget: placement never changes tokens; bytes, budget and errors."""

import itertools
import json
import os

import psutil
import pytest

from engine.run.bench import run_bench
from engine.format.checkpoint import Checkpoint
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError, ModelFormatError
from engine.run.generate import Sampler, generate
from engine.movement.io import uring_unavailable
from engine.format.layout import ExpertLayout
from engine.arch.registry import model_args
from engine.movement.plan import ACTIVATION_MARGIN, make_plan
from engine.run.runtime import Engine
from colibri_hf_models import build
from colibri_requirements import needs

PROMPT = [(5 * i + 11) % 256 for i in range(12)]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    # Experts big enough (96 KiB) that a few of them are a meaningful cache size.
    build("qwen3_moe", d, num_hidden_layers=3, moe_intermediate_size=128, hidden_size=64, mlp_only_layers=[],
          max_shard_size="200KB")
    return d


@pytest.fixture(scope="module")
def reference_tokens(model_dir):
    with Engine(model_dir, EngineConfig(threads=1, ctx_size=64)) as engine:
        assert not engine.plan.streaming
        return generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids


@pytest.fixture(scope="module")
def histogram(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("hist") / "routing.json"
    run_bench(model_dir, EngineConfig(threads=1, ctx_size=64), tokens=4, repeats=1, cold=False,
              record_routing=str(path))
    return str(path)


def budget_for_cache(model_dir, config: EngineConfig, cache_experts: int) -> int:
    """A budget whose plan leaves about `cache_experts` experts of RAM cache at this ratio."""
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    import torch
    plan = make_plan(ckpt, args, layout, config.replace(ram_budget=0), torch.float32, torch.float32)
    fixed = plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + psutil.Process().memory_info().rss + ACTIVATION_MARGIN
    fixed += plan.prefill_bytes
    ratio = config.cpu_cache_ratio or 1.0
    return fixed + int(cache_experts * plan.expert_bytes / ratio) + (1 << 20)


AXES = {"io_mode": ["direct", "buffered", "mmap"], "chunk_size": [4096, 65536], "prefetch_depth": [0, 1, 3],
        "cpu_cache_ratio": [0.0, 0.3, 1.0]}
POLICIES = ["lru", "lfu", "pinned"]
# Every combination of the four axes (54), each with one cache policy chosen by the sum of the axes'
# indices mod 3: a Latin-square assignment, so every policy meets every value of every axis (each
# (policy, ratio) pair 6 times) without tripling the grid. A plain cycle would tie each policy to
# one ratio (lru only ever with ratio 0, an empty cache), which test_grid_crosses_policy_with_every_axis
# guards against.
PLACEMENTS = [
    dict(zip(AXES, (values[i] for values, i in zip(AXES.values(), idx))), cache_policy=POLICIES[sum(idx) % 3])
    for idx in itertools.product(*(range(len(v)) for v in AXES.values()))
]


def test_grid_crosses_policy_with_every_axis():
    for axis, values in AXES.items():
        pairs = {(p["cache_policy"], p[axis]) for p in PLACEMENTS}
        assert pairs == set(itertools.product(POLICIES, values)), axis
    assert len({tuple(p.values()) for p in PLACEMENTS}) == len(PLACEMENTS) == 54


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_placement_never_changes_tokens(model_dir, reference_tokens, histogram, placement):
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, routing_histogram=histogram, **placement)
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, cache_experts=6))
    with Engine(model_dir, config) as engine:
        assert engine.plan.streaming
        tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == reference_tokens
    assert stats["bytes_read"] > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "pinned"])
def test_every_policy_with_small_and_full_cache(model_dir, reference_tokens, histogram, policy):
    for experts in (2, 100):
        config = EngineConfig(threads=1, ctx_size=64, cache_policy=policy, routing_histogram=histogram)
        config = config.replace(ram_budget=budget_for_cache(model_dir, config, experts))
        with Engine(model_dir, config) as engine:
            assert generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids == reference_tokens


def test_bytes_read_match_reads_issued(model_dir):
    config = EngineConfig(threads=1, ctx_size=64, cpu_cache_ratio=0.0, io_mode="buffered", prefetch_depth=0)
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, 0))
    with Engine(model_dir, config) as engine:
        assert engine.plan.cache_bytes == 0
        generate(engine, PROMPT, NEW_TOKENS, Sampler())
        stats = engine.io_stats()
        expert_bytes = engine.layout.expert_nbytes
    # No cache, no prefetch: every routed expert of every token is one demand read.
    assert stats["hit_rate"]["ram"] == 0.0
    assert stats["demand_reads"] > 0 and stats["prefetch_reads"] == 0
    assert stats["bytes_requested"] == stats["demand_reads"] * expert_bytes
    assert stats["bytes_read"] == stats["bytes_requested"]  # buffered: no alignment padding


def test_cache_hits_reduce_reads(model_dir):
    def reads(ratio):
        config = EngineConfig(threads=1, ctx_size=64, cpu_cache_ratio=ratio, io_mode="buffered")
        config = config.replace(ram_budget=budget_for_cache(model_dir, config, 100 if ratio else 0))
        with Engine(model_dir, config) as engine:
            generate(engine, PROMPT, NEW_TOKENS, Sampler())
            return engine.io_stats()["bytes_read"]
    assert reads(1.0) < reads(0.0)


def test_lookahead_recall_is_measured(model_dir):
    config = EngineConfig(threads=1, ctx_size=64, prefetch_depth=1, cpu_cache_ratio=0.0, io_mode="buffered")
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, 0))
    with Engine(model_dir, config) as engine:
        generate(engine, PROMPT, NEW_TOKENS, Sampler())
        stats = engine.io_stats()
    assert 0.0 < stats["lookahead_recall"] <= 1.0
    assert stats["prefetch_reads"] > 0
    # Each lookup is a cache hit, a prefetch that lookahead issued, or a demand read.
    total = stats["hit_rate"]["ram"] + stats["prefetch_coverage"] + stats["demand_read_rate"]
    assert total == pytest.approx(1.0) and stats["prefetch_coverage"] > 0


def test_direct_mode_really_uses_o_direct(model_dir):
    config = EngineConfig(threads=1, ctx_size=64, io_mode="direct", cpu_cache_ratio=0.0)
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, 0))
    with Engine(model_dir, config) as engine:
        generate(engine, PROMPT, 2, Sampler())
        shard = engine.layout.location(0, 0).spans[0].path
        flags = engine.experts.pool.open_flags(shard)
        assert engine.experts.pool.effective_mode == "direct"
    assert flags is not None and flags & os.O_DIRECT


def test_impossible_budget_lists_the_parts(model_dir):
    with pytest.raises(BudgetError) as err:
        Engine(model_dir, EngineConfig(ram_budget=8 << 20, ctx_size=64))
    msg = str(err.value)
    for part in ("dense weights", "KV cache", "read buffers", "runtime"):
        assert part in msg


def test_hostile_offsets_rejected_before_any_read(model_dir, tmp_path):
    import shutil
    import struct
    d = tmp_path / "hostile"
    shutil.copytree(model_dir, d)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 2**62]
    new = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    with pytest.raises(ModelFormatError, match="beyond the file|needs"):
        Checkpoint(d)


def test_bench_under_cgroup_limit_stays_in_budget(model_dir):
    from tuner.sandbox import detect_memory_cgroup
    from tuner.search.trial import run_trial
    budget = 480 << 20
    config = EngineConfig(threads=1, ctx_size=64, ram_budget=budget, io_mode="buffered", cpu_cache_ratio=0.5)
    trial = run_trial(model_dir, config, tokens=4, repeats=2, cold=True, limit_bytes=budget, timeout=120)
    assert trial.ok, trial.error
    m = trial.metrics
    assert m["plan"]["streaming"] and m["bytes_read_per_token"] > 0
    # Peak RSS also counts torch's shared-library pages, which the process maps in as it runs
    # (100-250 MiB here, more when the page cache holds the whole library): shared, clean and
    # reclaimable, and not charged to the trial's cgroup. Without them, the process's own peak
    # stays within the budget + 10% (allocator slack).
    assert m["peak_rss_bytes"] - m["rss_file_bytes"] <= budget * 1.10
    support = detect_memory_cgroup()
    assert trial.cgroup_limited == support.available
    if support.available:
        assert 0 < trial.cgroup_peak_bytes <= budget


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    build("llama", d, num_hidden_layers=4, hidden_size=128, intermediate_size=2048, max_shard_size="2MB")
    return d


def dense_budget(dense_dir, config, resident_layers):
    import torch
    ckpt = Checkpoint(dense_dir)
    args = model_args(ckpt.config)
    overhead = psutil.Process().memory_info().rss + ACTIVATION_MARGIN
    probe = make_plan(ckpt, args, None, config.replace(ram_budget=1 << 40), torch.float32, torch.float32, overhead)
    base = probe.dense_bytes - probe.resident_layers * probe.layer_bytes
    buffers = (1 + config.prefetch_depth) * (probe.layer_bytes + 2 * 4096)  # fp32 on disk and in compute
    fixed = base + probe.kv_bytes + buffers + overhead + probe.prefill_bytes
    return fixed + resident_layers * probe.layer_bytes + probe.layer_bytes // 2


@pytest.mark.parametrize("io_mode,prefetch", [("direct", 0), ("buffered", 1), ("mmap", 2), ("direct", 3)])
def test_dense_layer_streaming_keeps_tokens(dense_dir, io_mode, prefetch):
    with Engine(dense_dir, EngineConfig(threads=1, ctx_size=64)) as engine:
        reference = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
    config = EngineConfig(threads=1, ctx_size=64, io_mode=io_mode, prefetch_depth=prefetch)
    config = config.replace(ram_budget=dense_budget(dense_dir, config, resident_layers=2))
    with Engine(dense_dir, config) as engine:
        assert engine.plan.streaming and engine.plan.resident_layers == 2
        assert engine.model.streamed_layers == [2, 3]
        tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == reference
    # Every forward call (the prefill, then one per further token) reads each streamed layer's
    # tensors, exactly their bytes on disk, in whole-layer reads; read-ahead deeper than the
    # streamed layers may also have started up to `prefetch` reads for a call that never came.
    tensors = Checkpoint(dense_dir).tensors
    per_layer = [sum(t.nbytes for name, t in tensors.items() if name.startswith(f"model.layers.{i}."))
                 for i in (2, 3)]
    assert per_layer[0] == per_layer[1] > 0
    reads = stats["demand_reads"] + stats["prefetch_reads"]
    assert stats["bytes_requested"] == reads * per_layer[0]
    assert 2 * NEW_TOKENS <= reads <= 2 * NEW_TOKENS + prefetch


@pytest.mark.skipif(bool(uring_unavailable()), reason=needs("uring", f"io_uring unavailable here: {uring_unavailable()}"))
@pytest.mark.parametrize("io_mode,chunk_size,prefetch", [("direct", 4096, 0), ("direct", 1 << 20, 1),
                                                          ("buffered", 65536, 2)])
def test_uring_backend_keeps_tokens(model_dir, reference_tokens, io_mode, chunk_size, prefetch):
    """The io_uring reader gives the same tokens, whole spans or split ones, with lookahead."""
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, io_mode=io_mode, chunk_size=chunk_size,
                          prefetch_depth=prefetch, io_backend="uring")
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, cache_experts=6))
    with Engine(model_dir, config) as engine:
        tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == reference_tokens
    assert stats["io_backend_effective"] == "uring" and stats["bytes_read"] > 0
    assert stats["slot_overflows"] == 0
