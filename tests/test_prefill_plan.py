"""A long prompt under a memory budget: the plan counts one prefill group's activations (and one
sub-chunk's transients) and the KV cache the workload's longest request needs, the engine prefills
in groups of that size, and `tune --prompts` refuses a budget such prompts cannot fit before
anything runs. (Layer-major itself: tests/test_prefill_layer_major.py.)

The tiny model (engine/presets/tiny.json); no trial subprocess.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.arch.registry import model_args
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError
from engine.format.checkpoint import Checkpoint
from engine.movement.plan import (PREFILL_CHUNK, prefill_activation_bytes, prefill_bytes, prefill_tokens_per_pass,
                                  prefill_transient_bytes)
from engine.run.runtime import Engine
from tuner.search.space import MIN_PREFILL_CHUNK, ModelFacts, SearchSpace, prefill_chunk_for, prefill_chunks_for
from tuner.search.workload import prepare_workload

from colibri_tune_fixtures import MiB


def test_prefill_activations_grow_with_the_tokens_of_a_pass(model_dir):  # noqa: F811
    args = model_args(Checkpoint(model_dir).config)
    ctx = 4096  # the positions attended: the mask and the keys grow with the context, not the pass
    one, chunk = (prefill_activation_bytes(args, t, torch.bfloat16, ctx) for t in (1, PREFILL_CHUNK))
    per_token = prefill_activation_bytes(args, 2, torch.bfloat16, ctx) - one
    assert per_token > args.hidden_size * 2  # at least the residual stream, in bf16
    assert chunk == one + (PREFILL_CHUNK - 1) * per_token  # linear in the pass's tokens
    assert prefill_activation_bytes(args, PREFILL_CHUNK, torch.bfloat16, 2 * ctx) > chunk
    # A sub-chunk holds at most PREFILL_CHUNK tokens: a longer context charges no more transients.
    assert prefill_tokens_per_pass(16) == 16 and prefill_tokens_per_pass(1 << 20) == PREFILL_CHUNK


def test_the_plan_grows_with_the_longest_request(model_dir):  # noqa: F811
    """The tuner's pre-check: ctx_size follows the workload's longest prompt + output, and the
    plan's fixed part grows with it (KV for every position, the prefill group: the whole context)."""
    facts = ModelFacts.read(model_dir)
    fixed = {}
    for n in (8, 200, 4000):
        space = SearchSpace(budget=512 * MiB, physical_cores=1, logical_cores=1, has_gpu=False, min_ctx=n,
                            model=facts, overhead_bytes=100 * MiB)
        fixed[n] = space.fixed_bytes(space.smallest())
    assert fixed[8] < fixed[200] < fixed[4000]
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    from engine.format.layout import ExpertLayout
    from engine.movement.plan import make_plan
    plans = {n: make_plan(ckpt, args, ExpertLayout(ckpt, args), EngineConfig(ram_budget=512 * MiB, ctx_size=n),
                          torch.float32, torch.float32, overhead_bytes=100 * MiB) for n in (8, 200, 4000)}
    assert plans[8].prefill_bytes < plans[200].prefill_bytes < plans[4000].prefill_bytes
    assert all(plans[n].prefill_group == n for n in plans)  # room enough: one group for any prompt
    assert plans[4000].prefill_bytes == prefill_bytes(args, 4000, torch.float32, 4000, None,
                                                       plans[4000].prefill_norm_held)
    assert plans[8].kv_bytes < plans[200].kv_bytes < plans[4000].kv_bytes
    assert "prefill" in plans[4000].describe()


def test_a_chunked_prefill_gives_the_unchunked_logits_and_kv(model_dir):  # noqa: F811
    """Engine.forward(last_only) passes a long prompt through in chunks: same next-token
    distribution and same K/V as one pass over the whole prompt."""
    n = PREFILL_CHUNK + 40  # two passes: a whole chunk, then the rest
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(0))
    with Engine(model_dir, EngineConfig(ctx_size=512, prefill_chunk=PREFILL_CHUNK)) as engine:
        chunked = engine.forward(ids, 0, last_only=True)
        k_chunked = engine.kv.k[0][:, :n].clone()
        whole = engine.model.forward(ids, 0, engine.kv, last_only=True)  # one pass, overwriting the same KV
        k_whole = engine.kv.k[0][:, :n]
    assert chunked.shape == whole.shape == (1, engine.args.vocab_size)
    torch.testing.assert_close(chunked, whole, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(k_chunked, k_whole, atol=1e-3, rtol=1e-3)
    assert int(chunked.argmax()) == int(whole.argmax())


def _groups(engine, ids) -> tuple[list[int], torch.Tensor]:
    """The token counts of the groups Engine.forward(last_only) prefills `ids` in, and its logits."""
    groups = []
    real = engine.model.prefill
    engine.model.prefill = lambda t, *a, **k: groups.append(t.shape[0]) or real(t, *a, **k)
    try:
        logits = engine.forward(ids, 0, last_only=True)
    finally:
        engine.model.prefill = real
    return groups, logits


def test_the_default_group_is_the_whole_context_where_the_budget_has_room(model_dir):  # noqa: F811
    """prefill_chunk 0 (the default): one group of the whole prompt, resident or under a roomy
    budget (tests/test_prefill_layer_major.py: a tight one shrinks it); a set chunk wins."""
    assert EngineConfig().prefill_chunk == 0
    n = 2 * PREFILL_CHUNK + 40
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(2))
    for budget in (0, 4 << 30):
        with Engine(model_dir, EngineConfig(ctx_size=1024, ram_budget=budget)) as engine:
            assert engine.plan.prefill_group == 1024
            assert _groups(engine, ids)[0] == [n]
            assert engine.plan.prefill_bytes == prefill_bytes(engine.args, 1024, engine.dtype, 1024, None,
                                                              engine.plan.prefill_norm_held)
    with Engine(model_dir, EngineConfig(ctx_size=1024, ram_budget=4 << 30, prefill_chunk=96)) as engine:
        assert _groups(engine, ids)[0] == [96] * (n // 96) + [n % 96]


@pytest.mark.parametrize("chunk", [32, 7])
def test_the_configured_prefill_group_sets_the_groups_and_keeps_the_logits(model_dir, chunk):  # noqa: F811
    """prefill_chunk is the group the engine prefills a prompt in (and what the plan charges): a
    70-token prompt goes through in ceil(70 / chunk) groups with the one-pass logits."""
    n = 70
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(1))
    with Engine(model_dir, EngineConfig(ctx_size=512, prefill_chunk=chunk)) as engine:
        groups, grouped = _groups(engine, ids)
        whole = engine.model.forward(ids, 0, engine.kv, last_only=True)
        assert engine.plan.prefill_bytes == prefill_bytes(engine.args, chunk, engine.dtype, 512, None,
                                                          engine.plan.prefill_norm_held)
    assert groups == [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    torch.testing.assert_close(grouped, whole, atol=1e-3, rtol=1e-3)


def test_a_tune_sizes_the_prefill_group_to_its_workloads_longest_prompt(model_dir, tmp_path):  # noqa: F811
    """The fixed 8-token prompt runs every candidate with MIN_PREFILL_CHUNK-token groups, so the plan
    charges a small group and the expert cache gets the rest; a long prompt gets a group that holds
    it whole (each expert read once per layer)."""
    assert [prefill_chunk_for(n) for n in (1, 8, 32, 33, 200, 4000)] == [32, 32, 32, 64, 256, 4096]
    run = _tune_run(model_dir, tmp_path / "fixed", 1 << 30, None)
    assert run.space.prefill_chunk == MIN_PREFILL_CHUNK
    config = run.space.baseline()
    assert config.prefill_chunk == MIN_PREFILL_CHUNK
    args = model_args(Checkpoint(model_dir).config)
    assert prefill_transient_bytes(args, MIN_PREFILL_CHUNK, torch.bfloat16) < \
        prefill_transient_bytes(args, PREFILL_CHUNK, torch.bfloat16) / 4
    long_run = _tune_run(model_dir, tmp_path / "long", 1 << 30, _prompts(tmp_path, "long.jsonl", 60))
    longest = long_run.workload_info.prompt_tokens.max
    assert long_run.space.prefill_chunk == prefill_chunk_for(longest) >= longest > MIN_PREFILL_CHUNK


def _prompts(tmp_path, name: str, words: int) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"prompt": " ".join(f"w{i % 50}" for i in range(words)), "max_new_tokens": 4}) + "\n")
    return str(path)


def _tune_run(model_dir, out, budget: int, prompts: str):  # noqa: F811
    from tuner.search.options import TuneOptions
    from tuner.search.setup import TuneSession
    opts = TuneOptions(model=str(model_dir), ram_budget=budget, min_ctx=16, tokens=2, repeats=1, prompt_tokens=8,
                       out=out, seed=0, confirm_top=0, trials=1, prompts=prompts)
    run = TuneSession.prepare(opts, log=lambda m: None)
    return run


def test_a_long_prompt_tune_under_a_tight_budget_is_refused_before_running(model_dir, tmp_path):  # noqa: F811
    """A budget that holds the short workload's plan but not the long one's (its KV at the longest
    request's context, its prefill group): the long one is one BudgetError before the run
    directory, the calibration or any trial exists; the short one passes the same check."""
    short, long_ = _prompts(tmp_path, "short.jsonl", 4), _prompts(tmp_path, "long.jsonl", 110)
    facts = ModelFacts.read(model_dir)
    need = {}
    for name, path in (("short", short), ("long", long_)):
        work = prepare_workload(path, model_dir, 8, 2, facts.max_position_embeddings)
        ctx = work.ctx_needed
        space = SearchSpace(budget=1 << 40, physical_cores=1, logical_cores=1, has_gpu=False, min_ctx=max(16, ctx),
                            model=facts,  # the default overhead, as the check before calibration uses
                            prefill_chunk=prefill_chunk_for(work.info.prompt_tokens.max),
                            prefill_chunks=prefill_chunks_for(work.info.prompt_tokens.max))  # as tune searches
        need[name] = (ctx, space.fixed_bytes(space.smallest()))
    assert need["long"][0] > 300 and need["long"][1] > need["short"][1]
    budget = need["short"][1] + (need["long"][1] - need["short"][1]) // 2
    run = _tune_run(model_dir, tmp_path / "short-run", budget, short)
    assert run.space.min_ctx == max(16, need["short"][0])  # fits: the run could start
    with pytest.raises(BudgetError, match=rf"ctx_size {need['long'][0]}.*prefill"):
        _tune_run(model_dir, tmp_path / "long-run", budget, long_)
    assert not (tmp_path / "long-run").exists()
