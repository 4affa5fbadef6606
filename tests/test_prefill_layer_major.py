"""Layer-major prefill (engine/arch/prefill.py): a prompt's group goes through one layer at a time.

It must give today's pass-wise logits (every architecture, quantized KV too), read each routed
expert at most once per layer per group under a budget that cannot hold them all, keep placement
invariance, and have its activations charged by the memory plan (engine/movement/plan.py).
Tiny generated models (tests/colibri_hf_models.py, the tiny synth preset); no wall-clock asserts.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.arch.registry import model_args
from engine.base.config import PREFILL_CHUNK, EngineConfig
from engine.base.errors import BudgetError, DraftBudgetError
from engine.format.checkpoint import Checkpoint
from engine.format.layout import ExpertLayout
from engine.movement.plan import (make_plan, prefill_activation_bytes, prefill_bytes,
                                  prefill_group_bytes, prefill_tokens_per_pass)
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_hf_models import ARCHS, built_once
from test_streaming import budget_for_cache

from colibri_tune_fixtures import MiB

KiB = 1 << 10

N = 40  # prompt tokens: five sub-chunks of SUB
SUB = 8  # the tests' sub-chunk (the engine's is PREFILL_CHUNK): several per prompt on a tiny model
PROMPT = [(7 * i + 3) % 256 for i in range(N)]
ATOL = 1e-5  # fp32
# The quantized KV caches (engine/arch/kvquant.py); gpt_oss's windowed cache refuses them.
KV_CASES = [(arch, "auto") for arch in sorted(ARCHS)] + [
    (arch, kv) for arch in ("qwen3_moe", "deepseek_v3", "glm_moe_dsa") for kv in ("int8", "fp8")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return built_once(tmp_path_factory, "layer-major")


def _greedy_after(engine, logits, start: int, n: int) -> list[int]:
    out = [int(logits.argmax())]
    for i in range(n - 1):
        out.append(int(engine.model.forward(torch.tensor([out[-1]]), start + i, engine.kv).argmax()))
    return out


@pytest.mark.parametrize("arch,kv", KV_CASES, ids=[f"{a}-{k}" for a, k in KV_CASES])
def test_layer_major_gives_the_pass_wise_logits(hf_dirs, arch, kv):
    """fp32: the pass-wise prefill (passes of s tokens, each through every layer) and the layer-major
    one (the whole prompt one layer at a time, attention in sub-chunks of s) give the same
    last-position logits within 1e-5 and the same greedy continuation from the K/V each wrote, for
    s = SUB, 3 and the whole prompt. MLA's latents, the DSA indexer's selection (a "shared" layer
    reuses it per sub-chunk), gpt-oss's sinks and sliding ring (window 8 < N), quantized KV rows."""
    ids = torch.tensor(PROMPT)
    with Engine(hf_dirs(arch), EngineConfig(ctx_size=64, dtype="fp32", threads=1, kv_dtype=kv)) as engine:
        for s in (SUB, 3, N):
            for begin in range(0, N, s):
                passes = engine.model.forward(ids[begin:begin + s], begin, engine.kv, last_only=True)
            want = _greedy_after(engine, passes, N, 5)
            got = engine.model.prefill(ids, 0, engine.kv, s)
            assert got.shape == passes.shape == (1, engine.args.vocab_size)
            diff = (got - passes).abs().max().item()
            assert diff <= ATOL, f"{arch} kv {kv} sub {s}: max |dlogit| {diff:.2e}"
            assert _greedy_after(engine, got, N, 5) == want, f"{arch} kv {kv} sub {s}"


def test_the_engine_prefills_layer_major_in_groups(hf_dirs):
    """Engine.forward(last_only) takes the prompt through Transformer.prefill in groups of the
    plan's prefill_group (here prefill_chunk 16: 16, 16, 8) with the one-pass logits."""
    ids = torch.tensor(PROMPT)
    with Engine(hf_dirs("qwen3_moe"), EngineConfig(ctx_size=64, dtype="fp32", threads=1, prefill_chunk=16)) as engine:
        assert engine.plan.prefill_group == 16
        groups = []
        real = engine.model.prefill
        engine.model.prefill = lambda t, *a, **k: groups.append(t.shape[0]) or real(t, *a, **k)
        grouped = engine.forward(ids, 0, last_only=True)
        engine.model.prefill = real
        whole = engine.model.forward(ids, 0, engine.kv, last_only=True)
    assert groups == [16, 16, 8]
    assert (grouped - whole).abs().max().item() <= ATOL


# --- reads: each expert at most once per layer per group ---------------------------------------

LONG = 200  # tiny synth prompt: 8 experts x 4 layers, top-2: every group routes to most of them


def _long_prompt(vocab: int) -> list[int]:
    return [(13 * i + 5) % vocab for i in range(LONG)]


def _group_read_counts(engine, ids) -> list[Counter]:
    """Engine.forward(last_only) over ids; per group, the store's reads by (layer, expert)."""
    per_group = []
    real = engine.model.prefill

    def counted(t, *a, **k):
        engine.experts.reset_stats()
        out = real(t, *a, **k)
        per_group.append(Counter(engine.experts.read_counts))
        return out
    engine.model.prefill = counted
    try:
        engine.forward(ids, 0, last_only=True)
    finally:
        engine.model.prefill = real
    return per_group


@pytest.mark.parametrize("prefetch_depth,group", [(0, 0), (1, 0), (2, 64), (1, 64)])
def test_each_expert_is_read_at_most_once_per_layer_per_group(model_dir, prefetch_depth, group):  # noqa: F811
    """Under a budget whose cache holds 2 of the 32 experts (no cache at all: ratio 0), a 200-token
    prompt reads every expert it routes to once per layer per group, lookahead on or off; the
    pass-wise prefill of the same prompt (passes of 16) reads some of them again in later passes."""
    config = EngineConfig(threads=1, ctx_size=256, io_threads=2, prefetch_depth=prefetch_depth,
                          cpu_cache_ratio=0.0, prefill_chunk=group)
    config = config.replace(ram_budget=budget_for_cache(model_dir, config, cache_experts=2))
    with Engine(model_dir, config) as engine:
        assert engine.plan.streaming and engine.plan.cache_slots < engine.plan.routed_experts
        ids = torch.tensor(_long_prompt(engine.args.vocab_size))
        engine.experts.make_cold()
        groups = _group_read_counts(engine, ids)
        assert len(groups) == -(-LONG // engine.plan.prefill_group)
        for reads in groups:
            assert reads and max(reads.values()) == 1, reads.most_common(3)
            assert len({layer for layer, _ in reads}) == engine.args.num_layers
        engine.experts.make_cold()
        engine.experts.reset_stats()
        for begin in range(0, LONG, 16):
            engine.model.forward(ids[begin:begin + 16], begin, engine.kv, last_only=True)
        assert max(engine.experts.read_counts.values()) > 1  # what layer-major saves


def _held_before_issue_42(args, tokens: int, e: int) -> int:
    """What a group held per token before its routed slots were summed as they land (8c3ad8a..the
    routed sum): the residual and its norm, the routed output and every routed slot's weighted
    output [T*K, H], the routing and its sort, the rope rows."""
    return tokens * (2 * args.hidden_size * e + 2 * args.head_dim * e + (1 + args.top_k) * args.hidden_size * e
                     + args.top_k * (4 * 8 + 2 * e))


def test_a_prompt_the_old_charge_split_is_one_group_reading_each_expert_once(model_dir, monkeypatch):  # noqa: F811
    """Under a budget where a group's old state ([T*K, H] routed slots and the norm held) would have
    split a 4,000-token prompt into groups, the routed sum's charge fits the whole context: one group,
    and every expert the prompt routes to is read at most once per layer for the whole prompt (cache
    ratio 0: nothing is kept between layers' uses). The runtime overhead is given (the engine's own
    measurement, this process's RSS, moves with what ran before by more than the tiny model's state)."""
    ctx, n = 4096, 4000
    overhead = 200 * MiB
    config = EngineConfig(threads=1, ctx_size=ctx, io_threads=2, prefetch_depth=1, cpu_cache_ratio=0.0, dtype="fp32")
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    probe = make_plan(ckpt, args, ExpertLayout(ckpt, args), config.replace(ram_budget=1 << 40), torch.float32,
                      torch.float32, overhead_bytes=overhead)
    new, old = prefill_group_bytes(args, ctx, torch.float32, ctx), _held_before_issue_42(args, ctx, 4)
    assert old > 2 * new
    others = (probe.dense_bytes + probe.kv_bytes + probe.buffer_bytes + probe.overhead_bytes + probe.prefill_bytes
              - prefill_group_bytes(args, ctx, torch.float32, ctx, probe.prefill_norm_held))
    # (everything but the group's state: one sub-chunk's transients stay)
    budget = others + new + old  # half of what is left: between the new state and the old
    with Engine(model_dir, config.replace(ram_budget=budget), runtime_overhead_bytes=overhead) as engine:
        plan = engine.plan
        assert plan.streaming and plan.cache_slots == 0
        left = budget - (plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + plan.overhead_bytes
                         + prefill_activation_bytes(args, prefill_tokens_per_pass(ctx), torch.float32, ctx))
        old_fits = left // 2 // (old // ctx)
        assert old_fits < n, "the old charge would have taken the prompt in one group too: the budget shows nothing"
        assert plan.prefill_group == ctx
        ids = torch.tensor([(13 * i + 5) % engine.args.vocab_size for i in range(n)])
        engine.experts.make_cold()
        groups = _group_read_counts(engine, ids)
    assert len(groups) == 1
    reads = groups[0]
    assert reads and max(reads.values()) == 1, reads.most_common(3)
    assert {layer for layer, _ in reads} == set(range(args.num_layers))


def test_long_prompts_keep_placement_invariance(model_dir):  # noqa: F811
    """A prompt of more than one engine sub-chunk (PREFILL_CHUNK) in more than one group: every io
    mode, cache share and lookahead depth gives the resident run's greedy tokens."""
    prompt = _long_prompt(300)[:PREFILL_CHUNK // 2] * 3  # 384 tokens: two groups of 256, sub-chunks of 256
    base = EngineConfig(threads=1, ctx_size=512, io_threads=2, prefill_chunk=PREFILL_CHUNK)
    with Engine(model_dir, base) as engine:
        assert not engine.plan.streaming
        reference = generate(engine, prompt, 4, Sampler()).output_ids
    for io_mode, ratio, depth in (("direct", 0.0, 1), ("buffered", 1.0, 0), ("mmap", 0.3, 2)):
        config = base.replace(io_mode=io_mode, cpu_cache_ratio=ratio, prefetch_depth=depth)
        config = config.replace(ram_budget=budget_for_cache(model_dir, config, cache_experts=4))
        with Engine(model_dir, config) as engine:
            assert engine.plan.streaming
            assert generate(engine, prompt, 4, Sampler()).output_ids == reference, (io_mode, ratio, depth)


# --- the plan charges the group ----------------------------------------------------------------

def _plan(model_dir, **config):  # noqa: F811
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    return args, make_plan(ckpt, args, ExpertLayout(ckpt, args), EngineConfig(**config), torch.float32,
                           torch.float32, overhead_bytes=100 * MiB)


def _fits(model_dir, **config) -> bool:
    try:
        _plan(model_dir, **config)
    except BudgetError:
        return False
    return True


def test_drafting_leaves_a_prompts_group_as_it_is(model_dir):  # noqa: F811
    """A prompt's bits depend on its group (its matmuls' row counts), so the group must not move when
    drafting is turned on, or drafted greedy tokens would differ from plain ones: drafting's bytes
    come out of the expert cache wherever they fit beside the group, and where they do not, drafting
    is refused (DraftBudgetError, naming what it needs) instead of shrinking the group. (They took
    from the group's room, which made a depth-8 lookup engine prefill in groups of 64 where the plain
    one used 128, and its tokens differed.)"""
    compared = refused = 0
    budgets = [b * MiB for b in range(110, 400, 3)]
    # and the plain plan's edge in 32 KiB steps, where drafting's room runs out (prompt lookup's few
    # bytes a token fit wherever a few MiB are left)
    edge = next(b for b in budgets if _fits(model_dir, ctx_size=4096, ram_budget=b))
    budgets += [edge - 3 * MiB + i * 32 * KiB for i in range(96)]
    for budget in budgets:
        common = dict(ctx_size=4096, ram_budget=budget)
        try:
            _, off = _plan(model_dir, **common)
        except BudgetError:
            continue
        room = off.budget - (off.dense_bytes + off.kv_bytes + off.buffer_bytes + off.overhead_bytes
                             + off.prefill_bytes + off.prefix_cache_bytes)  # what the plain plan leaves the cache
        try:
            _, on = _plan(model_dir, **common, draft="fixed", draft_depth=8, drafter="lookup")
        except DraftBudgetError as e:
            assert "drafting needs" in str(e) and f"{off.prefill_group}-token prompt groups" in str(e), budget
            refused += 1
            continue
        assert on.draft_bytes > 0 and room >= on.draft_bytes, budget  # it fits beside the plain plan's group
        assert on.prefill_group == off.prefill_group and on.cache_bytes <= off.cache_bytes, budget
        compared += 1
    assert compared >= 10 and refused >= 1


def test_the_plan_charges_the_groups_activations(model_dir):  # noqa: F811
    """The charge is the group's state (the hidden state, the routed sum, the routing; no routed
    slot's output) plus one sub-chunk's transients; it grows with the group."""
    args, small = _plan(model_dir, ctx_size=4096, ram_budget=1 << 30, prefill_chunk=256)
    _, large = _plan(model_dir, ctx_size=4096, ram_budget=1 << 30, prefill_chunk=4096)
    assert (small.prefill_group, large.prefill_group) == (256, 4096)
    assert large.prefill_norm_held and small.prefill_norm_held  # room for the norm: held
    assert large.prefill_bytes == prefill_bytes(args, 4096, torch.float32, 4096, None, True)
    bare = prefill_group_bytes(args, 1, torch.float32, 4096)
    assert bare >= 2 * args.hidden_size * 4  # x and the routed sum
    assert bare < 3 * args.hidden_size * 4  # no routed slot's output is held
    per_token = prefill_group_bytes(args, 1, torch.float32, 4096, True)
    assert per_token == bare + args.hidden_size * 4  # ... and where there is room, the norm
    assert large.prefill_bytes - small.prefill_bytes == (4096 - 256) * per_token
    # Under a budget that holds the large group (without the norm: no room for it) and 4 experts, the
    # small group's saving goes to the cache.
    budget = (large.dense_bytes + large.kv_bytes + large.buffer_bytes + large.overhead_bytes
              + prefill_bytes(args, 4096, torch.float32, 4096) + 4 * large.cache_entry_bytes)
    tight = {g: _plan(model_dir, ctx_size=4096, ram_budget=budget, prefill_chunk=g)[1] for g in (256, 4096)}
    assert not tight[4096].prefill_norm_held
    assert tight[4096].cache_slots == 4 < tight[256].cache_slots  # what the group costs the expert cache
    assert "4096-token groups" in large.describe()


def test_a_budget_too_small_for_the_group_shrinks_the_default_and_refuses_a_set_one(model_dir):  # noqa: F811
    """prefill_chunk 0 (the default): the whole context when the budget has room, else the largest
    group in whole sub-chunks whose state fits half of what the budget leaves, or below one sub-chunk
    a smaller group with a smaller sub-chunk; a set prefill_chunk the budget cannot hold is refused,
    as is a budget that cannot hold a one-token group."""
    ctx = 8192
    args, roomy = _plan(model_dir, ctx_size=ctx, ram_budget=1 << 30)
    assert roomy.prefill_group == ctx
    assert roomy.prefill_norm_held
    per_token = prefill_group_bytes(args, 1, torch.float32, ctx)
    # Everything but the group's state and the cache: one sub-chunk's transients stay charged.
    others = (roomy.dense_bytes + roomy.kv_bytes + roomy.buffer_bytes + roomy.overhead_bytes
              + roomy.prefill_bytes - ctx * prefill_group_bytes(args, 1, torch.float32, ctx, True))
    budget = others + 1 * MiB + 2 * 1024 * per_token  # half of what is left: ~1024 tokens' state
    _, shrunk = _plan(model_dir, ctx_size=ctx, ram_budget=budget)
    assert PREFILL_CHUNK <= shrunk.prefill_group < ctx and shrunk.prefill_group % PREFILL_CHUNK == 0
    assert shrunk.prefill_bytes == prefill_bytes(args, shrunk.prefill_group, torch.float32, ctx, None,
                                                 shrunk.prefill_norm_held)
    assert shrunk.cache_bytes > 0
    with pytest.raises(BudgetError, match=rf"prefill activations \({ctx}-token groups\)"):
        _plan(model_dir, ctx_size=ctx, ram_budget=budget, prefill_chunk=ctx)
    # Less than one sub-chunk's state: a smaller group, its sub-chunk (and transients) with it.
    args, smaller = _plan(model_dir, ctx_size=ctx, ram_budget=others - 1 * MiB)
    assert 1 <= smaller.prefill_group < PREFILL_CHUNK
    assert smaller.prefill_bytes == prefill_bytes(args, smaller.prefill_group, torch.float32, ctx, None,
                                                  smaller.prefill_norm_held)
    transients = roomy.prefill_bytes - ctx * prefill_group_bytes(args, 1, torch.float32, ctx, True)
    with pytest.raises(BudgetError, match=r"prefill activations \(1-token groups\)"):
        _plan(model_dir, ctx_size=ctx, ram_budget=others - transients)
