"""Conversation workloads (engine/run/prompts_file.py): JSON Lines whose turns extend one another,
run by bench with the prefix cache reusing each turn's history, and tuned with the prefix cache's
share and the prefill group searched (tuner/search/space.py). Tiny synth model; no timing asserts."""

from __future__ import annotations

import json

import pytest

from engine.base.config import EngineConfig
from engine.base.errors import PromptError
from engine.run.generate import load_tokenizer
from engine.run.prompts_file import (Request, conversation_reuse, load_requests, load_workload, read_turns,
                                     save_requests, workload_digest)
from tuner.search.space import MIN_PREFILL_CHUNK, prefill_chunk_for, prefill_chunks_for, prefix_caches_for

from colibri_tune_fixtures import MiB

SYSTEM = "You are a terse assistant. " * 6


def _conversations(path, turns: int = 3, names=("a", "b"), words: int = 12) -> str:
    """Interleaved conversations: each turn resends its history (its previous prompt, an answer,
    the next message), as an OpenAI client does."""
    history = {name: SYSTEM + f"[{name}] " for name in names}
    lines = []
    for t in range(turns):
        for name in names:
            history[name] += " ".join(f"q{t}{name}{i}" for i in range(words)) + " "
            lines.append({"conversation": name, "prompt": history[name], "max_new_tokens": 2})
            history[name] += f"answer {t} "
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_a_conversation_file_reads_as_turns_that_extend_one_another(model_dir, tmp_path):  # noqa: F811
    path = _conversations(tmp_path / "c.jsonl")
    turns = read_turns(path, 8)
    assert [t.conversation for t in turns] == ["a", "b"] * 3
    assert all(turns[i + 2].prompt.startswith(turns[i].prompt) for i in range(4))
    requests = load_workload(path, load_tokenizer(model_dir), 8)
    assert [r.conversation for r in requests] == ["a", "b"] * 3
    reuse = conversation_reuse(requests)
    assert reuse["conversations"] == 2 and reuse["longest_history"] == max(len(r.prompt_ids) for r in requests)
    # Turns 2 and 3 of each resend the previous prompt: most of their tokens are shared.
    later = sum(len(r.prompt_ids) for r in requests[:4])
    assert later * 0.9 <= reuse["shared_tokens"] <= later
    # The tokenized copy a tune's trials read keeps the conversations; the digest names them.
    again = load_requests(save_requests(requests, tmp_path / "w.jsonl"))
    assert again == requests
    plain = [Request(r.prompt_ids, r.max_new_tokens) for r in requests]
    assert workload_digest(plain) != workload_digest(requests)
    assert conversation_reuse(plain)["conversations"] == 0


@pytest.mark.parametrize("lines,message", [
    ([{"conversation": "a", "prompt": "hello"}, {"conversation": "a", "prompt": "goodbye"}],
     r"line 2: turn 2 of conversation 'a' does not extend its turn 1 \(line 1\)"),
    ([{"conversation": "a", "prompt": "hello"}, {"conversation": "b", "prompt": "x"},
      {"conversation": "a", "prompt": "hello"}], r"line 3: turn 2 of conversation 'a' does not extend"),
    ([{"conversation": "", "prompt": "hello"}], r"line 1: \"conversation\" must be a non-empty string"),
    ([{"conversation": 3, "prompt": "hello"}], r"line 1: \"conversation\" must be a non-empty string"),
    ([{"conversation": "a", "prompt": "hi", "turn": 1}], r"unknown key 'turn'"),
])
def test_a_bad_conversation_file_is_one_error_line(lines, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(PromptError, match=message):
        read_turns(path, 8)


def test_bench_reuses_each_turns_history_with_the_prefix_cache(model_dir, tmp_path, capsys):  # noqa: F811
    """The same tokens with and without the prefix cache; with it, every turn after a
    conversation's first reuses its history (at least the previous prompt but the last token)."""
    from colibri.cli import main
    path = _conversations(tmp_path / "c.jsonl")
    requests = load_workload(path, load_tokenizer(model_dir), 8)
    runs = {}
    for prefix in ("0", "16MiB"):
        assert main(["bench", "--model", str(model_dir), "--prompts", path, "--repeats", "1", "--prefix-cache",
                     prefix, "--ctx-size", "512", "--json"]) == 0
        runs[prefix] = json.loads(capsys.readouterr().out)
    assert runs["0"]["output_ids"] == runs["16MiB"]["output_ids"]
    assert runs["0"]["runs"][0]["cached_tokens"] == 0
    shared = conversation_reuse(requests)["shared_tokens"]
    # interleaved: each turn's history comes back from RAM blocks, whole blocks of 64 positions
    assert shared - 64 * 4 <= runs["16MiB"]["runs"][0]["cached_tokens"] <= shared


def test_the_tune_space_searches_the_prefix_cache_and_the_prefill_group(model_dir, tmp_path):  # noqa: F811
    from tuner.search.options import TuneOptions
    from tuner.search.setup import TuneSession
    assert prefill_chunks_for(200) == (64, 128, 256) and prefill_chunks_for(8) == (MIN_PREFILL_CHUNK,)
    assert prefix_caches_for(1000, 1, 1024.0) == (0, MiB) and prefix_caches_for(1000, 3, 1024.0) == (0, MiB, 3 * MiB)
    path = _conversations(tmp_path / "c.jsonl", words=20)
    opts = TuneOptions(model=str(model_dir), ram_budget=1 << 30, min_ctx=16, tokens=2, repeats=1, prompt_tokens=8,
                       out=tmp_path / "run", seed=0, confirm_top=0, trials=1, prompts=path)
    run = TuneSession.prepare(opts, log=lambda m: None)
    space = run.space
    longest = run.workload_info.prompt_tokens.max
    assert run.workload_info.kind == "conversations"
    dists = space.distributions()
    assert dists["prefill_chunk"].choices == prefill_chunks_for(longest)
    caches = dists["prefix_cache"].choices
    assert len(caches) == 3 and caches[0] == 0 and caches[2] == 2 * caches[1] > 0  # off, one, both conversations
    assert "2 conversation(s)" in run.reuse_note
    base, least = space.baseline(), space.smallest()
    assert (base.prefill_chunk, base.prefix_cache) == (prefill_chunk_for(longest), caches[-1])
    assert (least.prefill_chunk, least.prefix_cache) == (min(prefill_chunks_for(longest)), 0)
    # Every point is a config the plan charges: its prefix cache and its group.
    point = {**space.params_of(base), "prefill_chunk": prefill_chunks_for(longest)[0], "prefix_cache": caches[1]}
    config = space.config_from_params(point)
    assert (config.prefill_chunk, config.prefix_cache) == (point["prefill_chunk"], caches[1])
    plan = space.model.plan(config, space.overhead_bytes)
    assert plan.prefix_cache_bytes == caches[1] and plan.prefill_group == point["prefill_chunk"]
    assert space.params_of(config) == point
    assert space.params_of(EngineConfig(ram_budget=1 << 30))["prefill_chunk"] == max(prefill_chunks_for(longest))
