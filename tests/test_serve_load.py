"""benchmarks/serving/serve_load.py, the clients serve_client.py's --arrivals and trace soak load
`colibri serve` with: simultaneous arrivals and a replayed trace against a real server on loopback
(every request answered, the server's own log lines read back per request), the SSE reader, and
the percentile the tables quote. Counts and statuses are asserted, never timings."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.base.config import EngineConfig
from engine.run.request_trace import read_trace
from benchmarks.serving import serve_load

from colibri_tiny import make_tiny
from test_serve import CTX, Server

BATCH = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    lines: list[str] = []
    tiny = make_tiny(tmp_path_factory.mktemp("serve-load") / "tiny")
    s = Server(tiny, EngineConfig(ctx_size=CTX, max_batch=BATCH, prefill_chunk=256), queue_size=8,
               log=lines.append, model_name="bench")
    s.lines = lines
    yield s
    s.close()


def test_simultaneous_arrivals_are_all_answered_and_the_log_gives_each_ones_wait_and_ttft(server):
    prompts = [[(7 * i + k) % 250 for i in range(5 + 3 * k)] for k in range(BATCH)]
    server.wait_idle()
    before = len(server.lines)
    results = serve_load.simultaneous(server.base, prompts, tokens=6)
    assert len(results) == BATCH
    for r in results:
        assert r["ttft_s"] is not None and r["sent_s"] >= 0
        assert 1 <= r["tokens"] <= 6
    logged = serve_load.log_requests("\n".join(server.lines[before:]))
    # one line per request, in the order they finished: their prompts' lengths, nothing cached
    assert sorted(e["prompt_tokens"] for e in logged) == sorted(map(len, prompts))
    assert all(e["cached"] == 0 and e["arrival_to_first_s"] >= e["ttft_s"] for e in logged)
    assert sorted(e["tokens"] for e in logged) == sorted(r["tokens"] for r in results)


def test_a_replayed_trace_sends_its_requests_and_samples_until_the_end(server, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in (
        {"at": 0.0, "prompt_ids": [5, 6, 7, 8], "max_tokens": 4},
        {"at": 0.0, "prompt": "Once upon a time", "max_tokens": 3, "n": 2},
        {"at": 0.0, "prompt_ids": [9, 10], "max_tokens": 5})) + "\n")
    samples = []
    load = serve_load.TraceLoad(server.base, read_trace(trace), gap=0.0)
    # Every arrival is at 0 s: the first cycle is sent at once, whatever the box's speed, and the
    # run waits for what is in flight when its time is up.
    load.run(0.2, every=60.0, sample=lambda t_s, done: samples.append(len(done)))
    assert load.sent >= 3 and len(load.results) == load.sent
    assert all(r["status"] == "ok" and r["ttft_s"] is not None for r in load.results)
    first = sorted(load.results, key=lambda r: r["request"])[:3]  # results come in the order they end
    assert [(r["line"], r["n"]) for r in first] == [(1, 1), (2, 2), (3, 1)]
    assert samples[0] == 0 and sum(samples) == load.sent  # the first sample before any answer, the last after all


def test_sse_payloads_are_split_at_line_feeds_only():
    """A sampled answer's text may hold U+2028 or U+0085, which JSON carries raw: str.splitlines
    (httpx's iter_lines) would cut the event there; the reader keeps it whole, across chunk breaks."""
    events = [{"text": "a\u2028b"}, {"text": "c\x85d\u00e9"}]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
    raw = body.encode()

    def handler(request):
        pieces = [raw[i:i + 5] for i in range(0, len(raw), 5)]  # breaks inside multi-byte characters
        return httpx.Response(200, stream=_Chunks(pieces))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with client.stream("GET", "http://x/") as r:
            got = list(serve_load.sse_data(r))
    assert [json.loads(d) for d in got[:-1]] == events and got[-1] == "[DONE]"


class _Chunks(httpx.SyncByteStream):
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces


def test_percentile_interpolates_between_the_closest_ranks():
    assert serve_load.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert serve_load.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert serve_load.percentile([7.0], 95) == 7.0
    assert serve_load.percentile([None], 50) is None
