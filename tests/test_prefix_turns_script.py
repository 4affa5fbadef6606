"""benchmarks/serving/prefix_turns.py: the conversation it sends (user messages of at least N tokens,
the same in every pass), the rounds' pass order, the table and target notes built from the passes'
results, and (slow) one small run end to end, each pass in its own process. No timing asserts: the
figures are fabricated where a verdict is checked."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import prefix_turns as pt


def _chars(text: str) -> list[str]:
    """A stand-in tokenizer: one id per non-space character."""
    return [c for c in text if c != " "]


def test_each_user_message_is_the_fewest_words_that_reach_the_token_count():
    msgs = pt.user_messages(_chars, turns=4, user_tokens=40, seed=3)
    assert len(msgs) == 4
    for m in msgs:
        assert len(_chars(m)) >= 40
        assert len(_chars(m.rsplit(" ", 1)[0])) < 40 or " " not in m  # one word fewer falls short
        assert set(m.split()) <= set(pt.WORDS)


def test_the_same_seed_gives_the_same_conversation_and_another_seed_another():
    assert pt.user_messages(_chars, 3, 30, seed=1) == pt.user_messages(_chars, 3, 30, seed=1)
    assert pt.user_messages(_chars, 3, 30, seed=1) != pt.user_messages(_chars, 3, 30, seed=2)


def test_the_default_context_holds_the_whole_conversation_in_whole_blocks_of_256():
    ctx = pt.default_ctx(turns=10, user_tokens=200, answer_tokens=64)
    assert ctx % 256 == 0
    assert ctx >= 10 * (200 + 64 + pt.TEMPLATE_SLACK) + 64
    assert ctx - 256 < 10 * (200 + 64 + pt.TEMPLATE_SLACK) + 64


def test_rounds_alternate_off_first_and_last_and_the_restart_always_follows_on():
    orders = [pt.round_order(r) for r in range(4)]
    assert [o[0] for o in orders] == ["off", "on", "off", "on"]
    for o in orders:
        assert sorted(o) == sorted(pt.PASSES)
        assert o.index("after restart") == o.index("on") + 1


def _run(ttfts: list[float], cached: list[int], answers="a", read=None) -> dict:
    turns = [{"turn": i + 1, "prompt_tokens": 100 * (i + 1), "cached_tokens": c, "answer_tokens": 8,
              "ttft_s": t, "turn_s": t + 1.0, "hit": None if read is None and c == 0 else int(c > 0),
              "expert_bytes_read": read, "expert_bytes_to_first": read, "kv_restored_bytes": None,
              "kv_disk_read_bytes": None, "answer_sha": answers + str(i)}
             for i, (t, c) in enumerate(zip(ttfts, cached))]
    return {"turns": turns, "load_s": 1.0, "wall_s": 10.0, "peak_bytes": None, "maxrss_mib": 300,
            "messages_sha": "m", "prefix": {}}


def test_summary_quotes_medians_over_rounds_and_judges_the_last_turn_against_the_second():
    runs = {"off": [_run([1.0, 2.0, 4.0], [0, 0, 0]), _run([1.0, 3.0, 5.0], [0, 0, 0])],
            "on": [_run([1.0, 1.0, 1.2], [0, 90, 190]), _run([1.0, 1.0, 1.6], [0, 90, 190])],
            "after restart": [_run([0.5, 1.0, 2.0], [64, 192, 256]), _run([0.5, 1.0, 2.0], [64, 192, 256])]}
    rows, notes = pt.summarize(runs)
    assert [(r["turn"], r["pass"]) for r in rows][:3] == [(1, "off"), (1, "on"), (1, "after restart")]
    assert len(rows) == 9
    last_off = next(r for r in rows if r["turn"] == 3 and r["pass"] == "off")
    assert last_off["ttft_s"] == {"median": 4.5, "min": 4.0, "max": 5.0, "n": 2}
    last_on = next(r for r in rows if r["turn"] == 3 and r["pass"] == "on")
    assert last_on["cached_tokens"] == 190 and last_on["hits"] == 2
    assert notes["turn 3 / turn 2 TTFT, on"].startswith("1.40x, met")
    assert notes["turn 3 / turn 2 TTFT, after restart"].startswith("2.00x, missed")
    assert notes["turn 3 / turn 2 TTFT, off"] == "1.80x, grows with the history"
    assert notes["turn 3 TTFT, off / on"] == "3.21x"
    assert notes["same user messages and greedy answers in every pass"] == "yes"


def test_summary_says_when_reuse_changed_an_answer():
    runs = {"off": [_run([1.0, 2.0, 3.0], [0, 0, 0])], "on": [_run([1.0, 1.0, 1.0], [0, 9, 9], answers="b")],
            "after restart": [_run([1.0, 1.0, 1.0], [9, 9, 9])]}
    _, notes = pt.summarize(runs)
    assert notes["same user messages and greedy answers in every pass"].startswith("no (1 message sets, 2 answer sets")


@pytest.mark.parametrize("flags, message", [
    (["--turns", "0"], "--turns 0: must be >= 1"),
    (["--budget", "lots"], "cannot parse size"),
    (["--prefix-cache", "0"], "--prefix-cache must be above 0"),
])
def test_bad_flags_are_one_line_and_status_2(flags, message, model_dir, capsys):
    assert pt.main(["--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_a_small_run_reuses_the_history_and_after_a_restart_reads_it_from_the_kv_directory(model_dir, capsys):
    """Three passes, each its own process: off reuses nothing; on reuses the previous turn's
    history; the restarted server finds the prompts in the KV directory the on pass left."""
    assert pt.main(["--model", str(model_dir), "--turns", "3", "--user-tokens", "32", "--answer-tokens", "4",
                    "--budget", "0", "--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "colibri.bench/1" and doc["tool"] == "prefix_turns"
    rows = {(r["turn"], r["pass"]): r for r in doc["rows"]}
    assert len(rows) == 9
    assert all(rows[(t, "off")]["cached_tokens"] == 0 for t in (1, 2, 3))
    assert rows[(1, "on")]["cached_tokens"] == 0
    for t in (2, 3):
        # the previous turn's prompt and answer are in the cache: all of it reused, nothing more
        assert rows[(t - 1, "on")]["prompt_tokens"] < rows[(t, "on")]["cached_tokens"] < rows[(t, "on")]["prompt_tokens"]
        assert rows[(t, "after restart")]["cached_tokens"] >= rows[(t, "on")]["cached_tokens"]
        assert rows[(t, "after restart")]["kv_mib_from_ssd"] > 0
    assert doc["notes"]["same user messages and greedy answers in every pass"] == "yes"
    assert doc["conditions"]["turns"] == 3 and doc["conditions"]["quant"] == "float32"
