"""Request traces (issue 39): the trace file's validator, its replay through serve's scheduler
(engine/run/trace_replay.py) and `bench --trace`'s JSON.

Behaviour only: the figures are checked against the arithmetic on the timestamps the scheduler
recorded (first token - arrival, ...), never against a wall-clock value; SLOs of 0 and of a day
give no request and every request within them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.api import BenchResult, EngineConfig, PromptError, TraceRequest, load_trace, read_trace
from engine.run.batch import BatchSequence
from engine.run.generate import Sampler, generate
from engine.run.request_trace import MAX_REQUESTS, check_context, save_trace, trace_digest
from engine.run.runtime import Engine
from engine.run.trace_replay import RequestRecord, replay, replay_figures, request_rows
from colibri.cli import main
from colibri_tiny import make_tiny
from colibri_tune_fixtures import ROOT

EXAMPLE = ROOT / "benchmarks" / "serving" / "traces" / "chat_burst.jsonl"
DAY = 86400.0


def write(path: Path, *lines) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


OK = {"at": 0, "prompt_ids": [1, 2, 3], "max_tokens": 4}


# --- the file's validator ---------------------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ("not json", "not valid JSON"),
    ([1, 2], "expected an object"),
    ({**OK, "stream": True}, 'unknown key "stream"'),
    ({**OK, "at": -0.5}, '"at" must be seconds in [0, 86400], got -0.5'),
    ({**OK, "at": "soon"}, '"at" must be seconds'),
    ('{"at": NaN, "prompt_ids": [1], "max_tokens": 4}', "NaN is not valid JSON"),
    ({**OK, "at": 1e9}, '"at" must be seconds in [0, 86400]'),
    ({**OK, "max_tokens": 0}, '"max_tokens" must be an integer in [1, 65536], got 0'),
    ({**OK, "max_tokens": True}, '"max_tokens" must be an integer'),
    ({**OK, "max_tokens": 2.5}, '"max_tokens" must be an integer'),
    ({"at": 0, "max_tokens": 4}, 'exactly one of "prompt" (text) and "prompt_ids"'),
    ({**OK, "prompt": "hi"}, 'exactly one of "prompt" (text) and "prompt_ids"'),
    ({**{k: v for k, v in OK.items() if k != "prompt_ids"}, "prompt": "  "}, '"prompt" must be a non-empty string'),
    ({**OK, "prompt_ids": []}, '"prompt_ids" must be a non-empty list'),
    ({**OK, "prompt_ids": [1, -3]}, '"prompt_ids"[1] must be a token id (an integer >= 0), got -3'),
    ({**OK, "prompt_ids": [1, "2"]}, '"prompt_ids"[1] must be a token id'),
    ({**OK, "n": 0}, '"n" must be an integer in [1, 128], got 0'),
    ('{"at": 0, "at": 1, "prompt_ids": [1], "max_tokens": 4}', "duplicate key"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, line, needle):
    path = write(tmp_path / "t.jsonl", OK, "", line)  # a blank line still counts in the numbering
    with pytest.raises(PromptError) as err:
        read_trace(path)
    message = str(err.value)
    assert message.startswith(f"--trace {path}:3: ") and "\n" not in message, message
    assert needle in message, message


def test_arrivals_out_of_order_empty_and_too_many(tmp_path):
    with pytest.raises(PromptError, match=r":2: \"at\" 0.5 is before the line before's 1 "):
        read_trace(write(tmp_path / "order.jsonl", {**OK, "at": 1}, {**OK, "at": 0.5}))
    with pytest.raises(PromptError, match="no request in the file"):
        read_trace(write(tmp_path / "empty.jsonl", "", "  "))
    many = write(tmp_path / "many.jsonl", *[OK] * (MAX_REQUESTS + 1))
    with pytest.raises(PromptError, match=rf":{MAX_REQUESTS + 1}: more than {MAX_REQUESTS} requests"):
        read_trace(many)
    with pytest.raises(PromptError, match="is a directory"):
        read_trace(tmp_path)


def test_tokenizing_checks_vocabulary_tokenizer_and_context(tmp_path):
    path = write(tmp_path / "t.jsonl", OK, {**OK, "at": 0.5, "prompt_ids": [7, 300], "n": 2})
    with pytest.raises(PromptError, match=r"t.jsonl:2: token id 300 is outside the model's vocabulary \(0..299\)"):
        load_trace(path, None, vocab=300)
    requests = load_trace(path, None, vocab=301)
    assert requests[1] == TraceRequest(0.5, (7, 300), 4, 2, line=2)
    text = write(tmp_path / "text.jsonl", OK, {"at": 1, "prompt": "hello there", "max_tokens": 2})
    with pytest.raises(PromptError, match=r"text.jsonl:2: a text \"prompt\" needs the model's tokenizer.json"):
        load_trace(text, None, vocab=300)
    check_context(requests, 7, path)
    with pytest.raises(PromptError, match=r"t.jsonl:1: the request needs 7 tokens \(3 of prompt \+ 4 new\), "
                                          r"more than --ctx-size 6"):
        check_context(requests, 6, path)
    # the tokenized copy a tune's trials replay reads back the same
    again = load_trace(save_trace(requests, tmp_path / "copy.jsonl"), None, vocab=301)
    assert [(r.at, r.prompt_ids, r.max_tokens, r.n) for r in again] == \
        [(r.at, r.prompt_ids, r.max_tokens, r.n) for r in requests]
    assert trace_digest(again) == trace_digest(requests)


def test_the_committed_example_is_a_valid_trace_for_every_model():
    lines = read_trace(EXAMPLE)
    assert 12 <= len(lines) <= 24
    ats = [r.at for r in lines]
    assert ats.count(0.0) >= 3 and max(b - a for a, b in zip(ats, ats[1:])) >= 1.0  # a burst and a gap
    assert all(r.prompt_ids is not None for r in lines)  # ids, not text: no tokenizer needed
    assert len({len(r.prompt_ids) for r in lines}) > 5 and all(16 <= r.max_tokens <= 64 for r in lines)
    load_trace(EXAMPLE, None, vocab=300)  # the tiny preset's vocabulary, the smallest of the presets


def test_bench_refuses_a_bad_trace_in_one_line_before_loading(tmp_path, capsys):
    path = write(tmp_path / "t.jsonl", OK, {**OK, "at": 0, "max_tokens": -1})
    code = main(["bench", "--model", str(tmp_path / "no-such-model"), "--trace", str(path)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert f"--trace {path}:2: \"max_tokens\" must be an integer" in lines[0]
    code = main(["bench", "--model", "x", "--slo-ttft", "1"])
    assert code != 0 and "--slo-ttft and --slo-tpot go with --trace" in capsys.readouterr().err


# --- the figures from recorded timestamps -----------------------------------------------------

def fake_sequence(tokens: int, admitted: float | None, first: float | None, last: float | None,
                  outcome: str = "finished") -> BatchSequence:
    gen = SimpleNamespace(output_ids=list(range(tokens)))
    s = BatchSequence(decoding=SimpleNamespace(gen=gen, prompt_ids=[1]))
    s.admitted, s.first_token_at, s.last_token_at, s.outcome = admitted, first, last, outcome
    return s


def test_figures_are_the_arithmetic_of_the_timestamps():
    r = lambda at, n=1: TraceRequest(at, (1, 2), 4, n)  # noqa: E731
    a = RequestRecord(r(0.0), 100.0, [fake_sequence(4, 100.0, 100.5, 101.1)])  # TTFT 0.5, TPOT 0.2
    b = RequestRecord(r(0.0), 100.0, [fake_sequence(3, 100.9, 101.5, 102.5)])  # TTFT 1.5, TPOT 0.5, wait 0.9
    c = RequestRecord(r(1.0, 2), 101.0, [fake_sequence(2, 101.2, 101.4, 101.6),  # TTFT 0.4 / TPOT 0.2
                                         fake_sequence(1, 101.2, 101.8, 101.8)])  # one token: no TPOT
    d = RequestRecord(r(2.0), 102.0, [fake_sequence(2, 102.1, 102.3, None, "error")])
    e = RequestRecord(r(3.0, 4), 103.0, refused="4 sequences of one prompt: more than max_batch 2")
    records = [a, b, c, d, e]
    assert (a.ttft_s, a.tpot_s, a.wait_s) == pytest.approx((0.5, 0.2, 0.0))
    assert (b.ttft_s, b.tpot_s, b.wait_s) == pytest.approx((1.5, 0.5, 0.9))
    assert (c.ttft_s, c.tpot_s, c.wait_s) == pytest.approx((0.8, 0.2, 0.2))  # its slowest sequence's
    assert not d.finished and not e.finished and e.ttft_s is None

    f = replay_figures(records, slo_ttft=1.0, slo_tpot=0.3)
    makespan = 103.0 - 100.0  # first arrival to the last event (e's arrival, after every token)
    assert f["makespan_s"] == pytest.approx(makespan)
    assert f["slo_met"] == 2 and f["goodput_rps"] == pytest.approx(2 / makespan)  # a and c
    assert (f["requests"], f["finished"], f["refused"]) == (5, 3, 1)
    assert f["ttft_p50_s"] == pytest.approx(0.8) and f["ttft_p95_s"] == pytest.approx(0.8 + 0.9 * 0.7)
    assert f["tpot_p50_s"] == pytest.approx(0.2) and f["tpot_p95_s"] == pytest.approx(0.2 + 0.9 * 0.3)
    assert f["aggregate_tok_s"] == pytest.approx((4 + 3 + 2 + 1 + 2) / makespan)
    # one sequence's decode rate: the tokens after the first over the time between first and last
    assert f["decode_tok_s"] == pytest.approx((3 + 2 + 1 + 0) / (0.6 + 1.0 + 0.2 + 0.0))
    assert replay_figures(records, 0.0, 0.0)["slo_met"] == 0 and replay_figures(records, 0.0, 0.0)["goodput_rps"] == 0
    everyone = replay_figures(records, DAY, DAY)
    assert everyone["slo_met"] == 3 and everyone["goodput_rps"] == pytest.approx(3 / makespan)
    assert replay_figures(records, 1.0, None)["slo_met"] == 2  # b's TTFT 1.5 alone misses
    assert replay_figures(records, None, 0.3)["slo_met"] == 2  # b's TPOT 0.5 alone misses
    rows = request_rows(records, 1.0, 0.3)
    assert [row["met"] for row in rows] == [True, False, True, False, False]
    assert rows[3]["outcome"] == "error" and rows[4]["outcome"] == "refused" and "max_batch 2" in rows[4]["error"]


# --- a replay on a tiny model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("trace") / "m")


SMALL = [TraceRequest(0.0, (5, 6, 7, 8, 9), 4), TraceRequest(0.0, (11, 12), 3),
         TraceRequest(0.0, (3, 1, 4, 1, 5, 9, 2), 5), TraceRequest(0.01, (20, 21, 22), 4, n=2),
         TraceRequest(0.02, (8, 8), 1), TraceRequest(0.03, (40, 41), 2, n=3)]


def test_replay_runs_every_request_and_times_it_from_its_arrival(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=2, ctx_size=64))
    try:
        records, steps = replay(engine, SMALL)
        solo = [generate(engine, list(r.prompt_ids), r.max_tokens, Sampler()).output_ids for r in SMALL[:5]]
    finally:
        engine.close()
    assert len(records) == len(SMALL)
    done, refused = records[:5], records[5]
    # n = 3 above max_batch 2: refused as serve refuses it, counted, never run
    assert refused.refused and "max_batch 2" in refused.refused and not refused.sequences
    for rec, req, ids in zip(done, SMALL, solo):
        assert rec.finished and len(rec.sequences) == req.n
        assert rec.output_ids == [ids] * req.n  # greedy: each sequence's solo tokens, whatever ran beside it
        for s in rec.sequences:
            # the scheduler keeps the arrival as its submit time; admitted no earlier, tokens after
            assert rec.arrival == s.submitted <= s.admitted <= s.first_token_at <= s.last_token_at
            assert s.wait_seconds == s.admitted - rec.arrival
        assert rec.ttft_s == pytest.approx(max(s.first_token_at for s in rec.sequences) - rec.arrival)
        if req.max_tokens > 1:
            assert rec.tpot_s == pytest.approx(max((s.last_token_at - s.first_token_at) / (req.max_tokens - 1)
                                                   for s in rec.sequences))
        else:
            assert rec.tpot_s is None
    # three arrive at once for two caches: the third is admitted only once one of the first two has left
    first_two_end = min(s.last_token_at for rec in done[:2] for s in rec.sequences)
    assert done[2].sequences[0].admitted >= first_two_end
    assert steps.max_rows == 2 and steps.decode_steps > 0
    assert steps.prefill_tokens == sum(len(r.prompt_ids) for r in SMALL[:5])  # prefix cache off: every prompt

    none = replay_figures(records, 0.0, 0.0)
    everyone = replay_figures(records, DAY, DAY)
    assert none["slo_met"] == 0 and none["goodput_rps"] == 0
    makespan = max(s.last_token_at for rec in done for s in rec.sequences) - records[0].arrival
    assert everyone["makespan_s"] == pytest.approx(max(makespan, refused.arrival - records[0].arrival))
    assert everyone["slo_met"] == 5 and everyone["goodput_rps"] == pytest.approx(5 / everyone["makespan_s"])
    assert everyone["generated_tokens"] == sum(r.max_tokens * r.n for r in SMALL[:5])


def test_bench_trace_json(tiny, tmp_path):
    path = save_trace(SMALL[:5], tmp_path / "small.jsonl")
    out = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--model", str(tiny), "--trace", str(path),
                          "--slo-ttft", str(DAY), "--slo-tpot", str(DAY), "--max-batch", "2", "--ctx-size", "64",
                          "--repeats", "2", "--warm", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    r = BenchResult.from_dict(m)
    assert m["schema"] == "colibri.metrics/1" and m["kind"] == "bench" and len(m["runs"]) == 2
    assert m["trace"] == {"source": "small.jsonl", "requests": 5, "sequences": 6, "sha256": trace_digest(SMALL[:5]),
                          "span_s": 0.02, "slo_ttft_s": DAY, "slo_tpot_s": DAY, "max_batch": 2, "temperature": 0.0,
                          "top_p": None}
    assert m["config"]["max_batch"] == 2 and m["tokens_consistent"] is True
    assert r.slo_met == 5 and all(run["slo_met"] == 5 and run["finished"] == 5 for run in m["runs"])
    # each figure is a field of the typed result: the median over the repeats, their spread in summary
    for key in ("goodput_rps", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "queue_wait_p50_s",
                "queue_wait_p95_s", "aggregate_tok_s", "makespan_s", "batch_mean"):
        assert getattr(r, key) == m[key] == m["summary"][key]["median"] and m["summary"][key]["n"] == 2, key
    assert r.goodput_rps == pytest.approx(sum(5 / run["makespan_s"] for run in m["runs"]) / 2)  # median of two
    rows = m["runs"][0]["per_request"]
    assert [row["line"] for row in rows] == [1, 2, 3, 4, 5] and all(row["met"] for row in rows)
    # compared across configs: the requests of n = 1 (any max_batch runs them); every request's apart
    assert len(m["output_ids"]) == sum(req.max_tokens for req in SMALL[:5] if req.n == 1)
    assert [len(ids) for ids in m["runs"][0]["request_output_ids"][3]] == [4, 4]
    assert all(run["batch_max"] == 2 for run in m["runs"])
