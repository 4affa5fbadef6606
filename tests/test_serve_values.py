"""`colibri serve` on input it cannot take (issue 37, item 5): a lone surrogate in a prompt, broken
framing, chat messages with null content. Each is a 400 whose body is an OpenAI error object, and
the server's log (its stderr) holds no traceback. A real server process on raw sockets
(tests/colibri_http.py): framing errors never reach the app, so only the wire shows them."""

from __future__ import annotations

import pytest

from colibri_http import ServeProcess, exchange, post
from colibri_tiny import make_tiny


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-values")
    s = ServeProcess(make_tiny(root / "tiny"), root / "serve.log")
    yield s
    s.close()


def assert_openai_400(reply, *needles):
    assert reply.status == 400, reply.raw[:500]
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def assert_log_clean(server):
    log = server.log_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}'),
    ("/v1/completions", rb'{"prompt": ["\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "x\udbff"}], "max_tokens": 2}'),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}'),
])
def test_a_lone_surrogate_is_a_400_error_object(server, path, body):
    assert_openai_400(post(server.port, path, body), "lone UTF-16 surrogate")
    assert_log_clean(server)


def test_a_surrogate_pair_is_text_and_is_served(server):
    reply = post(server.port, "/v1/completions", rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}')
    assert reply.status == 200, reply.raw[:500]
    assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("content", [b"null", None])
def test_chat_messages_with_null_or_no_content_are_a_400(server, content):
    message = b'{"role": "user"' + (b', "content": ' + content if content else b"") + b"}"
    err = assert_openai_400(post(server.port, "/v1/chat/completions", b'{"messages": [' + message + b"]}"),
                            "messages[0].content", "is required")
    assert err["param"] == "messages[0].content"


GARBAGE_CHUNKS = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\nzz\r\ngarbage\r\n0\r\n\r\n")


@pytest.mark.parametrize("request_bytes", [
    GARBAGE_CHUNKS,
    GARBAGE_CHUNKS.replace(b"zz", b"-1"),
    GARBAGE_CHUNKS.replace(b"zz", b"f" * 21),  # h11 reads at most 20 hex digits
    b"NOT HTTP AT ALL\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
])
def test_broken_framing_is_a_json_400_without_a_traceback(server, request_bytes):
    assert_openai_400(exchange(server.port, request_bytes, timeout=30), "framing")
    assert_log_clean(server)


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro",
    GARBAGE_CHUNKS.replace(b"zz", b"f" * 20),  # a chunk of 2^80 bytes announced, a few sent
])
def test_a_body_shorter_than_announced_leaves_no_traceback(server, request_bytes):
    # The client stops mid-body: the app's read ends in a disconnect, and nobody is left to
    # answer; the property is the log's (no ClientDisconnect traceback) and the server's health.
    exchange(server.port, request_bytes, timeout=30, half_close=True)
    ok = post(server.port, "/v1/completions", b'{"prompt": "a", "max_tokens": 1}')
    assert ok.status == 200
    assert_log_clean(server)
