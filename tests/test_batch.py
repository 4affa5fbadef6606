"""The batch scheduler (engine/run/batch.py): sequences admitted at step boundaries into a pool of KV
caches, prompts prefilled one group per step between decode steps (several prompts' groups in one
pass while they fit one group; at most stall_tokens while others decode), the running ones decoded together; each sequence's tokens those of
generate() alone. Tiny generated models of every
architecture; steps are counted, never timed.
"""

from __future__ import annotations

import pytest
import torch

from engine.base.config import EngineConfig
from engine.base.errors import PromptError
from engine.run.batch import BatchSequence, Scheduler, copy_positions
from engine.run.generate import Decoding, Sampler, generate
from engine.run.runtime import Engine
from colibri_hf_models import ARCHS, built_once

PROMPTS = [[(5 * i + 1) % 200 for i in range(9)], [(11 * i + 7) % 200 for i in range(4)],
           [(3 * i + 2) % 200 for i in range(13)]]
JOIN = [0, 2, 3]  # the step each sequence is submitted at
NEW = [12, 8, 6]  # tokens each generates: the second leaves while the others go on
GROUP = 4  # prompt tokens per prefill group (EngineConfig.prefill_chunk): 9 and 13 take several steps


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return built_once(tmp_path_factory, "batch")


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{"ctx_size": 64, "dtype": "fp32", "threads": 1, "max_batch": 3, "prefill_chunk": GROUP,
                           **kw})


def _seq(engine, prompt, n, sampler=None, **kw) -> BatchSequence:
    return BatchSequence(Decoding(engine, prompt, n, sampler or Sampler()), **kw)


def _drive(sched: Scheduler, joins: dict[int, list]) -> list:
    """Steps until idle, submitting joins[step] (sequences or groups) before that step; the steps' infos."""
    infos, step = [], 0
    while sched.active or any(k >= step for k in joins):
        for item in joins.get(step, []):
            sched.submit(item)
        infos.append(sched.step())
        step += 1
    return infos


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sequences_started_at_different_steps_get_their_solo_tokens(hf_dirs, arch):
    """Three prompts of different lengths submitted at steps 0, 2 and 3, one leaving early: each
    sequence's tokens are generate()'s alone, no step prefills more than one group (so a running
    sequence waits at most one group between its tokens), and every sequence past its first token
    decodes in every step until it leaves."""
    with Engine(hf_dirs(arch), _config()) as engine:
        solo = [generate(engine, p, n, Sampler()).output_ids for p, n in zip(PROMPTS, NEW)]
        sched = Scheduler(engine)
        seqs = [_seq(engine, p, n) for p, n in zip(PROMPTS, NEW)]
        infos = _drive(sched, {at: [s] for at, s in zip(JOIN, seqs)})
        assert [s.decoding.gen.output_ids for s in seqs] == solo
        assert all(s.outcome == "finished" for s in seqs)
        assert max(i.prefill_tokens for i in infos) <= GROUP
        assert sum(i.prefill_tokens for i in infos) == sum(map(len, PROMPTS))
        # decode steps: every sequence's tokens after its first came one per step
        assert sum(i.rows for i in infos) == sum(NEW) - len(NEW)
        assert max(i.rows for i in infos) == 3


def test_a_cancelled_sequence_leaves_at_once_and_the_others_are_unchanged(hf_dirs):
    with Engine(hf_dirs("qwen3_moe"), _config()) as engine:
        solo = [generate(engine, p, 8, Sampler()).output_ids for p in PROMPTS]
        sched = Scheduler(engine)
        stop = {"now": False}
        seqs = [_seq(engine, PROMPTS[0], 8), _seq(engine, PROMPTS[1], 8, cancelled=lambda: stop["now"]),
                _seq(engine, PROMPTS[2], 8)]
        left = []
        for s in seqs:
            s.on_done = left.append
            sched.submit(s)
        while len(seqs[1].decoding.gen.output_ids) < 3:
            sched.step()
        stop["now"] = True
        free = sched.pool.free()
        sched.step()
        assert seqs[1].outcome == "cancelled" and left[0] is seqs[1]
        assert sched.pool.free() == free + 1  # its cache went back at that step
        assert seqs[1].decoding.gen.output_ids == solo[1][:3]
        sched.run()
        assert [s.decoding.gen.output_ids for s in (seqs[0], seqs[2])] == [solo[0], solo[2]]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prompts_that_arrive_together_are_prefilled_in_one_pass_with_their_solo_tokens(hf_dirs, arch):
    """Three prompts (9, 4, 13 tokens) submitted at one step with groups of 16: the first two fit one
    group together and get their first tokens at step 0 from one pass (each expert fetched once per
    layer for both), the third (9 + 4 + 13 > 16) at step 1; every answer is generate()'s alone."""
    with Engine(hf_dirs(arch), _config(prefill_chunk=16)) as engine:
        solo = [generate(engine, p, n, Sampler()).output_ids for p, n in zip(PROMPTS, NEW)]
        sched = Scheduler(engine)
        seqs = [_seq(engine, p, n) for p, n in zip(PROMPTS, NEW)]
        for s in seqs:
            sched.submit(s)
        infos = [sched.step()]
        assert infos[0].prefill_tokens == 9 + 4
        assert [s.state for s in seqs] == ["decode", "decode", "prefill"]
        infos.append(sched.step())
        assert infos[1].prefill_tokens == 13 and infos[1].rows == 2
        sched.run()
        assert [s.decoding.gen.output_ids for s in seqs] == solo


def test_a_joint_prefill_pass_fetches_each_expert_once_for_its_parts_and_gives_their_own_logits(hf_dirs):
    """Engine.prefill_parts over two prompts: each part's last logits are its own prefill_into's
    (fp32, within rounding: an expert's matmul has the other part's rows beside its own) and the
    store hands out each (layer, expert) once for both, fewer than the two passes alone."""
    with Engine(hf_dirs("qwen3_moe"), _config(prefill_chunk=16)) as engine:
        alone, fetched_alone = [], 0
        for p in PROMPTS[:2]:
            kv, before = engine.new_cache(), engine.experts.fetched
            alone.append(engine.prefill_into(kv, p, 0))
            fetched_alone += engine.experts.fetched - before
        kvs, before = [engine.new_cache(), engine.new_cache()], engine.experts.fetched
        engine.model.record_routing()
        joint = engine.prefill_parts([(kv, p, 0) for kv, p in zip(kvs, PROMPTS[:2])])
        log = engine.model.routing_log
        union = sum(len({e for ids in calls for e in ids.flatten().tolist()}) for calls in log)  # per layer
        engine.model.record_routing(False)
        assert engine.experts.fetched - before == union < fetched_alone
        for a, j in zip(alone, joint):
            torch.testing.assert_close(j, a, rtol=1e-5, atol=1e-5)
            assert int(j.argmax()) == int(a.argmax())


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_newcomer_is_prefilled_in_short_passes_only_while_others_decode(hf_dirs, arch):
    """Groups of 16 and stall_tokens 4: a 13-token prompt alone goes through in one pass; the same
    prompt arriving while another sequence decodes goes 4, 4, 4, 1 tokens per step, the running
    sequence decoding at every one of those steps (its wait between tokens is one short pass, not
    the group). stall_tokens 0 gives it the whole group at once. Every answer is generate()'s alone."""
    with Engine(hf_dirs(arch), _config(prefill_chunk=16)) as engine:
        short, long = PROMPTS[1], PROMPTS[2]
        solo = [generate(engine, p, n, Sampler()).output_ids for p, n in ((short, 10), (long, 4))]

        lone = Scheduler(engine, stall_tokens=4)
        alone = _seq(engine, long, 4)
        infos = _drive(lone, {0: [alone]})
        assert infos[0].prefill_tokens == 13
        assert alone.decoding.gen.output_ids == solo[1]

        for stall, passes in ((4, [4, 4, 4, 1]), (0, [13])):
            sched = Scheduler(engine, stall_tokens=stall)
            running, newcomer = _seq(engine, short, 10), _seq(engine, long, 4)
            infos = _drive(sched, {0: [running], 2: [newcomer]})
            assert [i.prefill_tokens for i in infos[:2]] == [4, 0]
            during = infos[2:2 + len(passes)]
            assert [i.prefill_tokens for i in during] == passes
            assert all(i.rows >= 1 for i in during)  # the running sequence took a token at each of them
            assert [s.decoding.gen.output_ids for s in (running, newcomer)] == solo


def test_admission_waits_while_max_batch_sequences_run(hf_dirs):
    """max_batch 2 and three sequences submitted together: the third gets a cache only at the step
    after one leaves (FIFO), the pool never holds more than two caches, and the tokens are the solo ones."""
    with Engine(hf_dirs("mixtral"), _config(max_batch=2)) as engine:
        lengths = [3, 6, 4]
        solo = [generate(engine, p, n, Sampler()).output_ids for p, n in zip(PROMPTS, lengths)]
        sched = Scheduler(engine)
        seqs = [_seq(engine, p, n) for p, n in zip(PROMPTS, lengths)]
        for s in seqs:
            sched.submit(s)
        admitted_at, left_at, step = {}, {}, 0
        while sched.active:
            info = sched.step()
            for s in info.admitted:
                admitted_at[seqs.index(s)] = step
            for i, s in enumerate(seqs):
                if s.state == "done" and i not in left_at:
                    left_at[i] = step
            assert len(sched.running) <= 2
            step += 1
        assert admitted_at[0] == admitted_at[1] == 0
        assert admitted_at[2] == min(left_at[0], left_at[1]) + 1
        assert len(sched.pool.slots) == 2
        assert [s.decoding.gen.output_ids for s in seqs] == solo
        assert seqs[2].wait_seconds >= seqs[0].wait_seconds


@pytest.mark.parametrize("arch,prefix", [("qwen3_moe", 0), ("gpt_oss", 1 << 20), ("deepseek_v3", 0),
                                         ("glm_moe_dsa", 1 << 20)])
def test_a_group_shares_one_prefill_and_samples_with_its_own_seeds(hf_dirs, arch, prefix):
    """n = 3 sequences of one prompt: the prompt is prefilled once, its positions copied into the
    other two caches (gpt_oss with the prefix cache on: from the engine's cache, every position, into
    the others' sliding rings), and each choice is generate()'s with its own seed; greedy, all three
    are the solo greedy answer."""
    prompt = PROMPTS[2]
    with Engine(hf_dirs(arch), _config(prefix_cache=prefix)) as engine:
        def alone(sampler):
            engine.forget_prefixes()  # each computes the whole prompt, as the group does
            return generate(engine, prompt, 8, sampler).output_ids

        sampled = [alone(Sampler(temperature=1.0, seed=40 + i)) for i in range(3)]
        greedy = alone(Sampler())
        engine.forget_prefixes()
        for samplers, want in (([Sampler(temperature=1.0, seed=40 + i) for i in range(3)], sampled),
                               ([Sampler() for _ in range(3)], [greedy] * 3)):
            sched = Scheduler(engine)
            group = sched.submit([_seq(engine, prompt, 8, s) for s in samplers])
            infos = _drive(sched, {})
            assert sum(i.prefill_tokens for i in infos) == len(prompt)  # prefilled once, for all three
            assert [s.decoding.gen.output_ids for s in group] == want
            engine.forget_prefixes()
        assert len(set(map(tuple, sampled))) > 1  # the seeds differ, and so do the answers


def test_a_group_larger_than_max_batch_is_refused(hf_dirs):
    with Engine(hf_dirs("qwen3_moe"), _config(max_batch=2)) as engine:
        with pytest.raises(PromptError, match="max_batch 2"):
            Scheduler(engine).submit([_seq(engine, PROMPTS[0], 2) for _ in range(3)])


def test_copy_positions_between_a_full_cache_and_a_ring(hf_dirs):
    """gpt_oss: the engine's cache with the prefix cache on keeps every position of its sliding layers,
    a new_cache() a ring; a copy either way keeps the window's positions in their slots."""
    with Engine(hf_dirs("gpt_oss"), _config(prefix_cache=1 << 20)) as engine:
        full, ring = engine.kv, engine.new_cache()
        assert any(a.shape != b.shape for a, b in zip(full.k, ring.k))
        engine.prefill_into(full, list(range(1, 40)), 0)
        copy_positions(full, ring, 39)
        for a, b in zip(full.k, ring.k):
            size = b.shape[1]
            for p in range(max(0, 39 - size), 39):
                assert torch.equal(b[:, p % size], a[:, p % a.shape[1]])


def test_prefix_reuse_finds_a_turn_in_any_cache_of_the_pool(hf_dirs):
    """With the prefix cache on, a conversation's next turn (its history resent) reuses the positions
    its cache still holds (the pool gives it that cache back), and a prompt that shares a block-long
    prefix with a sequence another cache ran restores it from the RAM blocks."""
    with Engine(hf_dirs("qwen3_moe"), _config(ctx_size=256, prefix_cache=8 << 20)) as engine:
        turn = [(7 * i + 3) % 200 for i in range(70)]
        other = [(13 * i + 5) % 200 for i in range(20)]
        sched = Scheduler(engine)
        a, b = _seq(engine, turn, 5), _seq(engine, other, 5)
        _drive(sched, {0: [a, b]})
        slot_of_a = next(s for s in sched.pool.slots if s.tokens[:70] == turn)
        follow = turn + a.decoding.gen.output_ids + [9, 8, 7]
        c = _seq(engine, follow, 4)
        _drive(sched, {0: [c, _seq(engine, other + [1, 2], 2)]})
        assert c.decoding.gen.cached_tokens == 70 + 5 - 1  # every position its cache held: prompt and answer
        assert slot_of_a.tokens[:len(follow)] == follow
        d = _seq(engine, turn[:64] + [1, 2, 3], 3)  # shares one 64-token block with `turn`
        e = _seq(engine, other, 3)
        sched2 = Scheduler(engine)  # a fresh pool: nothing live but the engine's own cache
        sched2.pool.slots[0].tokens[:] = []
        _drive(sched2, {0: [e, d]})
        assert d.decoding.gen.cached_tokens == 64


def test_the_union_a_batched_step_fetches_is_counted_per_moe_layer(hf_dirs):
    """StepInfo.union_experts is the union of the rows' routed experts per MoE layer (the routing
    log's), and at most the rows times top-k."""
    with Engine(hf_dirs("qwen3_moe"), _config()) as engine:
        sched = Scheduler(engine)
        seqs = [_seq(engine, p, 20) for p in PROMPTS]  # long enough that all three decode together
        for s in seqs:
            sched.submit(s)
        for _ in range(10):  # 9 + 4 + 13 prompt tokens in groups of 4: all decoding by then
            sched.step()
        assert all(s.state == "decode" for s in seqs)
        engine.model.record_routing()
        info = sched.step()
        log = engine.model.routing_log
        moe_layers = [layer for layer in range(engine.args.num_layers) if engine.args.is_moe_layer(layer)]
        union = sum(len({e for ids in log[layer] for e in ids.flatten().tolist()}) for layer in moe_layers)
        assert info.rows == 3 and info.union_experts * len(moe_layers) == union
        assert info.union_experts <= 3 * engine.args.top_k
        engine.model.record_routing(False)
        sched.run()


def test_bench_batch_reports_aggregate_and_per_sequence_speed_and_the_union(model_dir, capsys):
    """`colibri bench --batch 3`: three greedy sequences at once, each the solo greedy answer of its
    prompt (seed, seed + 1, seed + 2); the result carries the batch's figures (one field each) in
    --json and in the printed lines; streaming under a budget, bytes read per step too."""
    import json

    from colibri.cli import main
    from engine.run.generate import random_prompt_ids
    from test_streaming import budget_for_cache

    config = EngineConfig(threads=1, ctx_size=64, cpu_cache_ratio=0.0, max_batch=3, prefetch_depth=0)
    # 32 MiB over the plan: the process grows a little between this estimate and the engine's own.
    budget = budget_for_cache(model_dir, config, cache_experts=2) + (32 << 20)
    argv = ["bench", "--model", str(model_dir), "--batch", "3", "--tokens", "5", "--repeats", "1", "--prompt-tokens",
            "6", "--seed", "4", "--threads", "1", "--ctx-size", "64", "--ram-budget", str(budget),
            "--cpu-cache-ratio", "0", "--prefetch-depth", "0"]
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["batch"] == 3 and r["config"]["max_batch"] == 3 and r["plan"]["streaming"]
    for key in ("aggregate_tok_s", "sequence_tok_s", "bytes_read_per_step", "union_experts_per_step", "ttft_p95_s"):
        assert r[key] is not None and r[key] > 0, key
    with Engine(model_dir, config.replace(ram_budget=budget)) as engine:
        vocab, top_k = engine.args.vocab_size, engine.args.top_k
        solo = [generate(engine, random_prompt_ids(6, vocab, 4 + i), 6, Sampler()).output_ids for i in range(3)]
    assert r["output_ids"] == [t for ids in solo for t in ids]
    assert r["union_experts_per_step"] <= 3 * top_k
    assert r["runs"][0]["whole_steps"] >= 1
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "batch 3" in text and "aggregate" in text and "per sequence" in text and "experts per layer" in text
