"""`colibri serve` through the official `openai` client, on a tiny model, in this process: the routes,
streaming, stop sequences, seeded sampling, greedy output equal to `colibri run`, OpenAI error
objects, the bounded FIFO queue (503 + Retry-After), cancellation when a client leaves, a bounded
load test with flat memory, the API key, and `colibri chat` driven through a pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import uvicorn

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri.serve.app import build_app
from colibri.serve.chat_template import ChatTemplate
from colibri.serve.prometheus import ServerMetrics
from colibri.serve.protocol import Sampling
from colibri.serve.server import LoadedModel, ServeOptions, check_options, make_state
from colibri.serve.worker import Job, TextStream

from colibri_tiny import make_tiny
from test_streaming import budget_for_cache

ROOT = Path(__file__).resolve().parent.parent
CTX = 2048
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve") / "tiny")


class Server:
    """`colibri serve`'s app on a thread: `config` the engine's (ctx CTX by default), `kv_dir` and
    `kv_disk_bytes` the SSD tier of the prefix cache, `log` the worker's per-sequence lines, `opts`
    ServeOptions' fields."""

    def __init__(self, model_dir, config: EngineConfig | None = None, *, kv_dir=None, kv_disk_bytes: int = 0,
                 log=None, **opts):
        self.model = LoadedModel(model_dir, config or EngineConfig(ctx_size=CTX), queue_size=opts.pop("queue_size", 8),
                                 kv_dir=kv_dir, kv_disk_bytes=kv_disk_bytes, log=log)
        state = make_state(self.model, check_options(ServeOptions(port=0, **opts)))
        self.state = state
        self.uv = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:  # waiting for a condition, with a deadline
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.port = self.uv.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, api_key="unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def wait_idle(self):
        deadline = time.monotonic() + 60
        while self.model.worker.busy or self.model.worker.queue_length():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.model.close()


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, queue_size=4)
    yield s
    s.close()


def test_completion_greedy_equals_colibri_run(server, tiny):
    out = server.client().completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    run = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(tiny), "--prompt", "Hello there",
                          "--max-new-tokens", "8", "--ctx-size", str(CTX), "--json"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(expected["prompt_ids"])
    if choice.finish_reason == "length":
        assert choice.text == expected["text"]
        assert out.usage.completion_tokens == 8
    else:  # stopped at end-of-sequence: the same tokens up to it
        assert choice.finish_reason == "stop"
        assert expected["text"].startswith(choice.text)


def test_streamed_and_whole_chat_agree(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_sequence_cuts_the_text_and_says_stop(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="The", max_tokens=24, temperature=0).choices[0].text
    printable = [i for i in range(2, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i]
    if not printable:
        pytest.skip("greedy text of this model has no printable 2-character piece to stop at")
    stop = full[printable[0]:printable[0] + 2]
    for stream in (False, True):
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt="The", max_tokens=24, temperature=0, stop=[stop], stream=True))
        else:
            res = client.completions.create(model="tiny", prompt="The", max_tokens=24, temperature=0, stop=stop)
            got = res.choices[0].text
            assert res.choices[0].finish_reason == "stop"
        assert got == full[:full.find(stop)]


def test_seeded_sampling_is_reproducible(server):
    client = server.client()
    a, b = (client.completions.create(model="tiny", prompt="Once", max_tokens=10, temperature=0.9, top_p=0.95,
                                      seed=1234).choices[0].text for _ in range(2))
    assert a == b


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": ["a", 1]}, 400, "stop"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": CTX}, 400, "max_tokens"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_are_openai_error_objects(server, body, status, param):
    r = httpx.post(server.base + "/v1/completions", json={"model": "tiny", **body} if "model" not in body else body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_bad_json_unknown_fields_and_size_limit(server):
    r = httpx.post(server.base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "frequency_penalty": 0.5,
                                                           "user": "me", "some_future_field": {"a": 1}})
    assert ok.status_code == 200  # unknown fields are ignored, as OpenAI clients expect
    big = httpx.post(server.base + "/v1/completions", json={"prompt": "x" * (5 * MiB)})
    assert big.status_code == 413
    assert httpx.get(server.base + "/v1/nothing").json()["error"]["message"]


def test_the_client_raises_openai_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello " * 3000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def _stream_lines(base, body):
    """A streaming request held open: (client, response, its line iterator)."""
    c = httpx.Client(timeout=60)
    req = c.build_request("POST", base + "/v1/completions", json=body)
    resp = c.send(req, stream=True)
    return c, resp, resp.iter_lines()


def test_a_client_that_leaves_cancels_its_generation(server):
    server.wait_idle()
    before = server.metric("colibri_cancelled_total")
    generated = server.metric("colibri_generated_tokens_total")
    c, resp, lines = _stream_lines(server.base, {"prompt": "A", "max_tokens": CTX - 8, "stream": True,
                                                 "temperature": 0})
    first = next(line for line in lines if line.startswith("data:"))
    assert "choices" in first
    resp.close()
    c.close()
    server.wait_idle()
    assert server.metric("colibri_cancelled_total") == before + 1
    assert server.metric("colibri_generated_tokens_total") - generated < CTX - 8


def test_a_full_queue_answers_503_with_retry_after(tiny):
    s = Server(tiny, queue_size=1)
    release = threading.Event()

    def slow_consumer(kind, value):  # runs on the worker thread: holds the engine until released
        if kind == "text":
            release.wait(120)

    try:
        s.model.worker.submit(Job([5, 6, 7], Sampling(max_tokens=4, temperature=0, top_p=1, seed=0), slow_consumer))
        deadline = time.monotonic() + 30
        while not s.model.worker.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting = []
        t = threading.Thread(target=lambda: waiting.append(httpx.post(
            s.base + "/v1/completions", json={"prompt": "B", "max_tokens": 2}, timeout=120)))
        t.start()
        while s.model.worker.queue_length() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "C", "max_tokens": 2})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        release.set()
        t.join(timeout=120)
        assert waiting[0].status_code == 200  # the queued one ran once the engine was free
        assert s.model.worker.started_order == [1, 2]
    finally:
        release.set()
        s.close()


def test_load_many_clients_fifo_and_flat_memory(server):
    server.wait_idle()
    results: list[int] = []
    lock = threading.Lock()
    proc = psutil.Process()
    rss: list[int] = []

    def client_loop(k):
        with httpx.Client(timeout=120) as c:
            for i in range(20):
                r = c.post(server.base + "/v1/completions", json={"prompt": f"client {k} request {i}",
                                                                  "max_tokens": 4, "temperature": 0})
                with lock:
                    results.append(r.status_code)
                    if len(results) in (10, 160):
                        rss.append(proc.memory_info().rss)
                if r.status_code == 503:
                    assert r.headers["retry-after"]

    start_seq = len(server.model.worker.started_order)
    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 160
    assert set(results) <= {200, 503}
    assert results.count(200) >= 20
    started = server.model.worker.started_order[start_seq:]
    assert started == sorted(started)  # FIFO: jobs start in the order they were accepted
    assert rss[1] - rss[0] < 64 * MiB  # stated margin: no growth across requests beyond allocator noise


def test_api_key_is_required_and_checked(tiny):
    s = Server(tiny, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert [m.id for m in s.client("s3cret").models.list().data] == ["tiny"]
        assert httpx.get(s.base + "/health").status_code == 200
        assert httpx.get(s.base + "/metrics").status_code == 401
    finally:
        s.close()


def test_a_non_loopback_address_needs_a_key(monkeypatch):
    monkeypatch.delenv("COLIBRI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="api-key"):
        check_options(ServeOptions(host="0.0.0.0"))
    assert check_options(ServeOptions(host="0.0.0.0", api_key="k")).api_key == "k"
    monkeypatch.setenv("COLIBRI_API_KEY", "from-env")
    assert check_options(ServeOptions(host="0.0.0.0")).api_key == "from-env"


def test_cancel_at_the_next_token(tiny):
    model = LoadedModel(tiny, EngineConfig(ctx_size=CTX), queue_size=2)
    try:
        done = threading.Event()
        box = []

        def emit(kind, value):
            if kind == "text":
                job.cancelled.set()
            else:
                box.append(value)
                done.set()

        job = Job([5, 6, 7], Sampling(max_tokens=500, temperature=0, top_p=1, seed=0), emit)
        model.worker.submit(job)
        assert done.wait(60)
        assert box[0].finish_reason == "cancelled"
        assert len(box[0].generation.output_ids) <= 8  # stopped within a few tokens of the first text
    finally:
        model.close()


class _Chars:
    """A tokenizer whose tokens are characters (ids are code points), for TextStream's rules."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_and_cuts_at_it():
    s = TextStream(_Chars(), ["END"])
    pieces = [s.push(ord(c)) for c in "abcEN"]
    assert "".join(pieces) == "abc"  # "EN" may begin "END"
    assert s.push(ord("D")) == "" and s.stopped and s.text == "abc"
    s2 = TextStream(_Chars(), ["END"])
    assert "".join(s2.push(ord(c)) for c in "abENx") + s2.flush() == "abENx"


def _scraped(text: str) -> dict[str, float]:
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")}


def test_metrics_count_lookups_and_hits_per_tier_of_a_streaming_store(tiny):
    # The counters let a scraper take the hit rate over any window (the soak's per-interval rate);
    # they must be the store's own counts, and agree with the since-start rates beside them.
    config = EngineConfig(threads=1, ctx_size=64, cpu_cache_ratio=1.0)
    # 16 MiB over the plan: the RSS grows a little between this estimate and the engine's own.
    config = config.replace(ram_budget=budget_for_cache(tiny, config, cache_experts=6) + (16 << 20))
    with Engine(tiny, config) as engine:
        assert engine.plan.streaming
        generate(engine, [1, 2, 3, 4], 6, Sampler())
        first = _scraped(ServerMetrics().render(0, False, engine.io_stats()))
        generate(engine, [5, 6, 7], 6, Sampler())
        second = _scraped(ServerMetrics().render(0, False, engine.io_stats()))
        store = engine.store
        assert second["colibri_expert_lookups_total"] == store.lookups > first["colibri_expert_lookups_total"] > 0
        for tier in store.cache.tier_names:
            hits = second[f'colibri_expert_hits_total{{tier="{tier}"}}']
            assert hits == store.tier_hits.get(tier, 0)
            assert hits / store.lookups == pytest.approx(second[f'colibri_expert_hit_rate{{tier="{tier}"}}'], abs=1e-6)
        assert second['colibri_expert_hits_total{tier="ram"}'] > first['colibri_expert_hits_total{tier="ram"}']


def test_chat_template_renders_as_transformers_does(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
                "{% else %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((tiny / f).read_bytes())
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": " hi "},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    oracle = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    expected = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.for_model(tmp_path).render(messages) == expected


def test_chat_in_a_pseudo_terminal(tiny):
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat command on the terminal's other end
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "colibri.cli", "chat", "--model", str(tiny), "--ctx-size", "256",
                                  "--max-tokens", "6", "--kv-dir", str(tiny.parent / "kv")])  # not ~/.cache
    out = b""

    def read_until(pattern: bytes, timeout=120):
        nonlocal out
        deadline = time.monotonic() + timeout
        while not re.search(pattern, out):
            assert time.monotonic() < deadline, out.decode(errors="replace")
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                try:
                    out += os.read(fd, 4096)
                except OSError:
                    break
        return out

    try:
        read_until(rb"you> ")
        os.write(fd, b"hello\n")
        read_until(rb"\[\d+ tokens, TTFT [\d.]+ s")
        os.write(fd, b"second turn\n")
        read_until(rb"(?s)TTFT.*TTFT")
        os.write(fd, b"/exit\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert b"model> " in out
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.close(fd)
