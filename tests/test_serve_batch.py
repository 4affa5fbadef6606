"""`colibri serve` with continuous batching (issue 39): requests decoded together up to --max-batch,
`n` > 1 choices (each its own seed, reproducible; under a JSON schema, each sequence of the batched
step held to it by its own grammar), the batch's /metrics and log line, and a bounded loopback load of official `openai` clients with no error but the expected 503s and flat memory.
The engine-side scheduler's own tests: tests/test_batch.py."""

from __future__ import annotations

import re
import threading
import time

import httpx
import json
import jsonschema
import openai
import psutil
import pytest

from engine.base.config import EngineConfig
from colibri.cli import build_parser
from colibri.commands.serve import reuse_options
from colibri.serve.protocol import Sampling
from colibri.serve.worker import Job

from colibri_tiny import make_tiny
from test_serve import CTX, MiB, Server
from test_serve_grammar import NESTED

EOS = 256  # the tiny preset's end-of-sequence id
BATCH = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve-batch") / "tiny")


@pytest.fixture(scope="module")
def server(tiny):
    lines: list[str] = []
    s = Server(tiny, EngineConfig(ctx_size=CTX, max_batch=BATCH, prefill_chunk=256), queue_size=4, log=lines.append)
    s.lines = lines
    yield s
    s.close()


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # waiting for a condition, with a deadline
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_n_choices_are_reproducible_by_seed_and_each_is_its_own_seeds_answer(server):
    """n = 3: three choices (index 0..2) in one answer, the same again for the same seed, choice i the
    answer a single request with seed + i gets; usage counts the prompt once and every choice's tokens."""
    client = server.client()
    ask = dict(model="tiny", prompt="Once upon", max_tokens=10, temperature=0.9, top_p=0.95)
    out = client.completions.create(**ask, seed=77, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert [c.text for c in client.completions.create(**ask, seed=77, n=3).choices] == texts
    singles = [client.completions.create(**ask, seed=77 + i) for i in range(3)]
    assert [s.choices[0].text for s in singles] == texts
    assert len(set(texts)) > 1  # three seeds, three answers
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_streamed_n_choices_carry_their_index_and_match_the_whole_answer(server):
    client = server.client()
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0.8, seed=5, n=2)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text, finishes, roles = {0: "", 1: ""}, {}, set()
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1}
    assert [text[0], text[1]] == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_json_schema_choices_decode_together_each_under_its_own_grammar(server):
    """The mask on the batched decode path: n = 3 sequences of one step, each with its own grammar
    state, every choice a document of the schema and the one a request with seed + i alone gets."""
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": NESTED, "strict": True}}
    ask = dict(model="tiny", messages=[{"role": "user", "content": "JSON?"}], max_tokens=600, temperature=1,
               response_format=fmt)
    out = client.chat.completions.create(**ask, seed=21, n=BATCH)
    assert [c.finish_reason for c in out.choices] == ["stop"] * BATCH
    texts = [c.message.content for c in out.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), NESTED)
    assert len(set(texts)) > 1
    assert [client.chat.completions.create(**ask, seed=21 + i).choices[0].message.content
            for i in range(BATCH)] == texts


def test_n_above_max_batch_is_refused_by_name(server):
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": BATCH + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert f"at most {BATCH}" in r.json()["error"]["message"]


def test_requests_decode_together_with_their_solo_tokens_metrics_and_log(server):
    """A job holds the engine (its consumer blocks the worker thread) while two greedy requests queue;
    released, the three run in one batch: the two answers are the ones each gets alone, /metrics
    shows decode steps of more than one sequence, the union of their experts and the queue waits,
    and the log has a line per request with its wait, TTFT and tok/s."""
    server.wait_idle()
    hold = threading.Event()

    def slow(kind, value):  # on the worker thread: keeps the engine until released
        if kind == "text":
            hold.wait(120)

    before = _scrape(server)
    prompts = ["The quick brown fox", "Numbers: 1, 2, 3"]
    server.model.worker.submit(Job([5, 6, 7], Sampling(max_tokens=40, temperature=0, top_p=1, seed=0,
                                                       logit_bias={EOS: -100.0}), slow))
    _wait_for(lambda: server.model.worker.busy, "the first job started")
    answers: dict[int, str] = {}

    def ask(i):
        out = server.client().completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0,
                                                 logit_bias={str(EOS): -100})
        answers[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        _wait_for(lambda: server.model.worker.queue_length() == 2, "both requests queued")
    finally:
        hold.set()
    for t in threads:
        t.join(timeout=120)
    server.wait_idle()
    after = _scrape(server)
    alone = [server.client().completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                                logit_bias={str(EOS): -100}).choices[0].text for p in prompts]
    assert [answers[0], answers[1]] == alone
    def several(m):  # decode steps of more than one sequence
        return m["colibri_batch_size_count"] - m['colibri_batch_size_bucket{le="1"}']

    batched = several(after) - several(before)
    assert batched > 0  # steps that decoded two or three sequences together
    assert after["colibri_union_experts_count"] > before["colibri_union_experts_count"]
    assert after["colibri_queue_wait_seconds_count"] - before["colibri_queue_wait_seconds_count"] >= 3
    assert after["colibri_batch_running"] == 0
    logged = [line for line in server.lines if "prompt tokens" in line]
    assert logged and all(re.search(r"wait \d+\.\d+ s, TTFT \d+\.\d+ s, \d+ tokens at [\d.-]+ tok/s", line)
                          for line in logged)


def test_bounded_load_of_openai_clients_gives_answers_or_503_and_flat_memory(server):
    """Six `openai` clients in threads, each sending its own requests until it has sent them all
    (completions and chats, some streamed, some with n = 2, each ending by itself at max_tokens or
    end-of-sequence): every answer is a 200 with its choices or a 503 (queue of 4 full), requests
    start in the order they were accepted, and the RSS grows by less than the stated margin
    (64 MiB) between an early answer and the last."""
    server.wait_idle()
    proc = psutil.Process()
    statuses: list[int] = []
    rss: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def record(status):
        with lock:
            statuses.append(status)
            if len(statuses) in (8, 48):
                rss.append(proc.memory_info().rss)

    def one(client, k, i):
        n = 2 if (k + i) % 4 == 0 else 1
        if i % 2:
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"c{k} r{i}"}],
                                                    max_tokens=6, temperature=0.7, seed=k * 100 + i, n=n, stream=True)
            finished = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
            assert set(finished) == set(range(n)) and set(finished.values()) <= {"stop", "length"}
        else:
            out = client.completions.create(model="tiny", prompt=f"client {k} request {i}", max_tokens=5,
                                            temperature=0, n=n)
            assert len(out.choices) == n and all(c.finish_reason in ("stop", "length") for c in out.choices)

    def client_loop(k):
        client = server.client()
        for i in range(8):
            try:
                one(client, k, i)
                record(200)
            except openai.APIStatusError as exc:
                record(exc.status_code)
            except BaseException as exc:  # noqa: BLE001  reported below, with the thread's own failure
                errors.append(exc)
                record(-1)

    start = len(server.model.worker.started_order)
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:3]
    assert len(statuses) == 48 and set(statuses) <= {200, 503}
    assert statuses.count(200) >= 12
    started = server.model.worker.started_order[start:]
    assert started == sorted(started)  # FIFO
    assert rss[1] - rss[0] < 64 * MiB  # stated margin: the pool's caches are made once, nothing per request stays


def test_serve_has_max_batch_and_keeps_the_engine_prefill_group_for_it():
    """--max-batch is the knob's flag; the prefill group stays the engine's (the scheduler, not a
    smaller group, bounds a newcomer's stall: tests/test_batch.py), unless asked."""
    parser = build_parser("serve")
    config, _ = reuse_options(parser.parse_args(["serve", "--model", "m", "--max-batch", "4", "--kv-disk", "0"]),
                              "serve")
    assert (config.max_batch, config.prefill_chunk) == (4, 0)
    config, _ = reuse_options(parser.parse_args(["serve", "--model", "m", "--max-batch", "4", "--prefill-chunk", "128",
                                                 "--kv-disk", "0"]), "serve")
    assert config.prefill_chunk == 128
    config, _ = reuse_options(parser.parse_args(["serve", "--model", "m", "--kv-disk", "0"]), "serve")
    assert (config.max_batch, config.prefill_chunk) == (1, 0)


def _scrape(server) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics").text
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")}
