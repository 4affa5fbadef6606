"""Placement invariance over the new architectures: streaming, caching and read-ahead under a
budget give exactly the resident run's tokens (MLA with its latent cache, the DSA indexer,
sigmoid group routing, gpt_oss experts plain and MXFP4-dequantized on read)."""

import pytest

from engine.weights.mxfp4 import MXFP4_DEQUANT
from engine.run.bench import run_bench
from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_hf_models import build
from test_archs import write_mxfp4_checkpoint
from test_streaming import PLACEMENTS, budget_for_cache

PROMPT = [(5 * i + 11) % 256 for i in range(12)]
NEW_TOKENS = 8
# Experts of ~300 KiB, so a few of them are a meaningful cache and the budget's slack for the
# process's RSS drift (RUNTIME_SLACK) is a few experts at most; sharded so reads span files.
MODELS = {
    "deepseek_v3": dict(moe_intermediate_size=384),
    "glm4_moe": dict(moe_intermediate_size=384),
    "glm_moe_dsa": dict(moe_intermediate_size=384, index_topk=4),
    "gpt_oss": dict(intermediate_size=384),
    "gpt_oss_mxfp4": dict(intermediate_size=384),
}
RUNTIME_SLACK = 2 << 20


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    arch = name.removesuffix("_mxfp4")
    d = root / "model"
    build(arch, d, max_shard_size="800KB", **MODELS[name])
    if name.endswith("_mxfp4"):
        write_mxfp4_checkpoint(d, root / "mx")
        d = root / "mx"
    with Engine(d, EngineConfig(threads=1, ctx_size=64)) as engine:
        assert not engine.plan.streaming
        reference = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
    histogram = root / "routing.json"
    run_bench(d, EngineConfig(threads=1, ctx_size=64), tokens=4, repeats=1, cold=False,
              record_routing=str(histogram))
    return name, d, reference, str(histogram)


def test_placement_never_changes_tokens(model):
    name, d, reference, histogram = model
    # Each model takes every fifth placement, at its own offset: together they cover all of them.
    offset = sorted(MODELS).index(name)
    for placement in PLACEMENTS[offset::len(MODELS)]:
        config = EngineConfig(threads=1, ctx_size=64, io_threads=2, routing_histogram=histogram, **placement)
        config = config.replace(ram_budget=budget_for_cache(d, config, cache_experts=6) + RUNTIME_SLACK)
        with Engine(d, config) as engine:
            assert engine.plan.streaming
            tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
            stats = engine.io_stats()
        assert tokens == reference, f"{name}: {placement}"
        assert stats["bytes_read"] > 0


def test_lookahead_prefetches_with_the_architectures_router(model):
    name, d, reference, _ = model
    config = EngineConfig(threads=1, ctx_size=64, prefetch_depth=1, cpu_cache_ratio=0.0, io_mode="buffered")
    config = config.replace(ram_budget=budget_for_cache(d, config, 0) + RUNTIME_SLACK)
    with Engine(d, config) as engine:
        assert generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids == reference
        stats = engine.io_stats()
    assert stats["prefetch_reads"] > 0 and stats["lookahead_recall"] is not None


@pytest.mark.parametrize("model", ["gpt_oss_mxfp4"], indirect=True)
def test_mxfp4_dequantized_on_read_frees_its_read_slots(model, monkeypatch):
    """The dequantize-on-read path (COLIBRI_MXFP4_FUSED=0) is not zero-copy: the plan gives its
    store read slots only, so a cached expert must hold no view of its slot. It held one (its
    biases, already bf16, were returned as views) and every read past the cache's fill waited
    the slot guard out (5 s): the streamed run that looked hung."""
    _name, d, _, _ = model
    monkeypatch.setenv("COLIBRI_MXFP4_FUSED", "0")
    # bf16 compute, as gpt-oss runs: the biases are stored bf16, so `.to(bf16)` would be a view.
    with Engine(d, EngineConfig(threads=1, ctx_size=64, dtype="bf16")) as engine:
        reference = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, io_mode="direct", prefetch_depth=1, dtype="bf16")
    config = config.replace(ram_budget=budget_for_cache(d, config, cache_experts=6) + RUNTIME_SLACK)
    with Engine(d, config) as engine:
        assert engine.plan.streaming and engine.kernel == MXFP4_DEQUANT
        tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == reference
    assert stats["slot_overflows"] == 0 and stats["bytes_read"] > 0
