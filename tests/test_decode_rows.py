"""Batched decode (engine/arch/decode_rows.py): B rows in one step, each a sequence's next token in its
own KV cache, or consecutive positions of one cache (a speculative verify).

Each row must get exactly its solo decode's logits (the same bits: greedy tokens identical, batched
or not), whatever the other rows, when they joined or left; each routed expert the rows need is
fetched from the store once per layer per step. Tiny generated models of every architecture; no
wall-clock asserts.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import native
from engine.arch import row_ops
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError
from engine.arch.registry import model_args
from engine.format.checkpoint import Checkpoint
from engine.format.layout import ExpertLayout
from engine.movement.plan import make_plan, prefill_bytes
from engine.run.runtime import Engine
from colibri_hf_models import ARCHS, built_once
from colibri_native_cases import needs_native_int
from colibri_requirements import needs
from test_streaming import budget_for_cache

from colibri_tune_fixtures import MiB

PROMPTS = [[(5 * i + 1) % 200 for i in range(9)], [(11 * i + 7) % 200 for i in range(4)],
           [(3 * i + 2) % 200 for i in range(13)]]
JOIN = [0, 2, 3]  # the step each sequence joins the batch at
NEW = [7, 3, 6]  # tokens each generates: the second leaves while the others go on


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return built_once(tmp_path_factory, "decode-rows")


def _solo(engine, prompt, n):
    """Greedy tokens and every step's logits of one sequence decoded alone, in a fresh cache."""
    kv = engine.new_cache()
    logits = engine.prefill_into(kv, prompt, 0)
    tokens, steps = [int(logits[-1].argmax())], []
    for i in range(n - 1):
        step = engine.model.forward(torch.tensor([tokens[-1]]), len(prompt) + i, kv)
        steps.append(step[-1])
        tokens.append(int(step[-1].argmax()))
    return tokens, steps


def _batched(engine, prompts, join, new):
    """The same sequences decoded together: sequence s joins at step join[s] (prefilled then), each
    step one forward_rows over every running sequence, a sequence leaving once it has new[s] tokens."""
    kvs = [engine.new_cache() for _ in prompts]
    tokens = [[] for _ in prompts]
    steps = [[] for _ in prompts]
    running: list[int] = []
    step = 0
    while any(len(t) < n for t, n in zip(tokens, new)):
        for s, at in enumerate(join):
            if at == step:
                tokens[s].append(int(engine.prefill_into(kvs[s], prompts[s], 0)[-1].argmax()))
                running.append(s)
        running = [s for s in running if len(tokens[s]) < new[s]]
        if running:
            positions = [len(prompts[s]) + len(tokens[s]) - 1 for s in running]
            logits = engine.decode_rows([tokens[s][-1] for s in running], positions, [kvs[s] for s in running])
            for row, s in enumerate(running):
                steps[s].append(logits[row])
                tokens[s].append(int(logits[row].argmax()))
        step += 1
    return tokens, steps


def _check_same_as_solo(engine, label):
    solo = [_solo(engine, p, n) for p, n in zip(PROMPTS, NEW)]
    tokens, steps = _batched(engine, PROMPTS, JOIN, NEW)
    for s, (want_tokens, want_steps) in enumerate(solo):
        assert tokens[s] == want_tokens, f"{label} sequence {s}"
        assert len(steps[s]) == len(want_steps)
        for i, (got, want) in enumerate(zip(steps[s], want_steps)):
            assert torch.equal(got, want), f"{label} sequence {s} step {i}: max |d| {(got - want).abs().max():.2e}"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_row_gets_its_solo_logits_fp32(hf_dirs, arch):
    """fp32, every architecture (MLA latents, the DSA indexer, gpt-oss sinks and windows): three
    sequences of different prompt lengths joining at different steps, one leaving early, each get
    bit for bit the logits and tokens of decoding alone."""
    with Engine(hf_dirs(arch), EngineConfig(ctx_size=64, dtype="fp32", threads=1, max_batch=3)) as engine:
        _check_same_as_solo(engine, arch)


@pytest.mark.skipif(native.load() is not None, reason=needs("native", f"native kernels: {native.load()}"))
@pytest.mark.parametrize("arch,kv", [("qwen3_moe", "auto"), ("qwen3_moe", "int8"), ("mixtral", "auto"),
                                     ("deepseek_v3", "auto"), ("gpt_oss", "auto")])
def test_each_row_gets_its_solo_logits_bf16_native(hf_dirs, arch, kv):
    """bf16 with the native kernels: the solo decode takes the whole native step or the native
    attention and fused MoE layer; the batched rows the per-layer native pieces and row-independent
    multi-row calls. Bits equal all the same."""
    with Engine(hf_dirs(arch), EngineConfig(ctx_size=64, dtype="bf16", threads=1, max_batch=3, kv_dtype=kv)) as engine:
        _check_same_as_solo(engine, f"{arch} {engine.decode_plan.route}")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_row_gets_its_solo_logits_bf16_on_torchs_ops(hf_dirs, arch, monkeypatch):
    """bf16 without the native kernels (COLIBRI_NATIVE=0, or a CPU without avx512_bf16): where torch's
    own bf16 linear is row-independent here (row_ops.torch_rows_independent: no oneDNN bf16 matmul),
    the rows' projections and each expert's rows go through one torch call, elsewhere one row at a
    time; either way each row's logits are its solo decode's, bit for bit."""
    monkeypatch.setattr(native, "load", lambda again=False: "native kernels off for this test")
    monkeypatch.setattr(native, "ready", False)
    monkeypatch.setattr(native, "int_ready", False)
    with Engine(hf_dirs(arch), EngineConfig(ctx_size=64, dtype="bf16", threads=1, max_batch=3)) as engine:
        _check_same_as_solo(engine, f"{arch} torch bf16, rows independent: {row_ops.torch_rows_independent()}")


def test_torchs_rows_independence_is_what_the_probe_says(monkeypatch):
    """The probe's answer holds on a shape it did not try (a model's lm_head-like matrix, 13 rows), and
    where oneDNN takes bf16 matmuls the probe says no without trying."""
    row_ops.torch_rows_independent.cache_clear()
    independent = row_ops.torch_rows_independent()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3000, 320, generator=g).to(torch.bfloat16)
    x = torch.randn(13, 320, generator=g).to(torch.bfloat16)
    rows = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(13)])
    if independent:
        assert torch.equal(torch.nn.functional.linear(x, w), rows)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    row_ops.torch_rows_independent.cache_clear()
    try:
        assert not row_ops.torch_rows_independent()
    finally:
        row_ops.torch_rows_independent.cache_clear()


@needs_native_int()
@pytest.mark.parametrize("quant,scope", [("int8", "experts"), ("int4", "all")])
def test_quantized_containers_give_each_row_its_solo_logits(hf_dirs, tmp_path, quant, scope):
    """int8 / int4 containers (experts only, or every projection): the solo decode's native int calls
    (whole step, or int attention and fused int MoE) and the rows' multi-row int kernels agree bit for bit."""
    from engine.format.convert import convert
    convert(hf_dirs("qwen3_moe"), tmp_path / quant, quant=quant, group_size=32, scope=scope)
    with Engine(tmp_path / quant, EngineConfig(ctx_size=64, dtype="bf16", threads=1, max_batch=3)) as engine:
        _check_same_as_solo(engine, f"{quant} {scope} {engine.decode_plan.route}")


def test_a_verify_pass_of_consecutive_positions_equals_decoding_them_one_by_one(hf_dirs):
    """Rows sharing one cache at consecutive positions (a speculative verify of drafted tokens) give
    each position's decode logits, and leave the cache as decoding them one by one would."""
    with Engine(hf_dirs("glm_moe_dsa"), EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as engine:
        prompt, drafts = PROMPTS[0], [17, 4, 99, 23]
        kv = engine.new_cache()
        engine.prefill_into(kv, prompt, 0)
        one_by_one = [engine.model.forward(torch.tensor([t]), len(prompt) + i, kv)[-1] for i, t in enumerate(drafts)]
        after = engine.model.forward(torch.tensor([5]), len(prompt) + len(drafts), kv)[-1]
        kv2 = engine.new_cache()
        engine.prefill_into(kv2, prompt, 0)
        rows = engine.decode_rows(drafts, [len(prompt) + i for i in range(len(drafts))], [kv2] * len(drafts))
        for i, want in enumerate(one_by_one):
            assert torch.equal(rows[i], want), i
        assert torch.equal(engine.model.forward(torch.tensor([5]), len(prompt) + len(drafts), kv2)[-1], after)


def test_rows_of_one_cache_must_be_consecutive(hf_dirs):
    with Engine(hf_dirs("qwen3_moe"), EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as engine:
        kv = engine.new_cache()
        with pytest.raises(ValueError, match="consecutive positions"):
            engine.decode_rows([1, 2], [3, 5], [kv, kv])
        with pytest.raises(ValueError, match="outside the cache"):
            engine.decode_rows([1], [64], [kv])
        with pytest.raises(ValueError, match="one of each per row"):
            engine.decode_rows([1, 2], [3], [kv])


def test_each_expert_is_fetched_once_per_layer_per_step(model_dir):
    """Streaming under a budget whose cache holds 2 of the 32 experts: a step of 4 sequences reads
    every expert the rows route to at most once per layer (their union), where decoding the same 4
    tokens one after the other reads shared experts again; the tokens are the solo ones."""
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, prefetch_depth=0, cpu_cache_ratio=0.0, max_batch=4)
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, cache_experts=2))
    prompts = [[(7 * i + s) % 250 for i in range(6)] for s in range(4)]
    with Engine(model_dir, config) as engine:
        assert engine.plan.streaming
        kvs = [engine.new_cache() for _ in prompts]
        first = [int(engine.prefill_into(kv, p, 0)[-1].argmax()) for kv, p in zip(kvs, prompts)]
        engine.experts.make_cold()
        engine.experts.reset_stats()
        engine.model.record_routing()
        batched = engine.decode_rows(first, [6] * 4, kvs)
        reads = Counter(engine.experts.read_counts)
        union = {(layer, e) for layer, calls in enumerate(engine.model.routing_log)
                 for ids in calls for e in ids.flatten().tolist()}
        assert reads and max(reads.values()) == 1
        assert set(reads) == union
        solo_kvs = [engine.new_cache() for _ in prompts]
        for kv, p in zip(solo_kvs, prompts):
            engine.prefill_into(kv, p, 0)
        engine.experts.make_cold()
        engine.experts.reset_stats()
        alone = [engine.model.forward(torch.tensor([t]), 6, kv)[-1] for t, kv in zip(first, solo_kvs)]
        assert sum(engine.experts.read_counts.values()) > sum(reads.values())  # what the batch saves
        for row, want in enumerate(alone):
            assert torch.equal(batched[row], want)


def _plan(model_dir, **config):
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    return make_plan(ckpt, args, ExpertLayout(ckpt, args), EngineConfig(**config), torch.float32, torch.float32,
                     overhead_bytes=100 * MiB)


def test_the_plan_charges_a_kv_cache_per_batched_sequence(model_dir):
    """max_batch B: the plan's KV charge is B caches (the engine's own keeps every position where the
    prefix cache needs it; the others hold positions only); a budget that holds two refuses four,
    naming the KV cache."""
    single = _plan(model_dir, ctx_size=4096).kv_bytes
    assert _plan(model_dir, ctx_size=4096, max_batch=4).kv_bytes == 4 * single
    two = _plan(model_dir, ctx_size=4096, max_batch=2, ram_budget=1 << 40, prefill_chunk=256)
    # Room for one cached expert beside the group's state without the norm (a budget this tight
    # leaves no room to hold it: plan.prefill_norm_held).
    args = model_args(Checkpoint(model_dir).config)
    prefill = prefill_bytes(args, 256, torch.float32, 4096, torch.float32)
    budget = two.dense_bytes + two.kv_bytes + two.buffer_bytes + two.overhead_bytes + prefill + two.cache_entry_bytes
    assert 2 * single > two.cache_entry_bytes
    assert _plan(model_dir, ctx_size=4096, max_batch=2, ram_budget=budget, prefill_chunk=256).cache_slots == 1
    with pytest.raises(BudgetError, match="KV cache"):
        _plan(model_dir, ctx_size=4096, max_batch=4, ram_budget=budget, prefill_chunk=256)
