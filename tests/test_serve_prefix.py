"""Prefix reuse through `colibri serve` and the official `openai` client: usage reports the reused
tokens (prompt_tokens_details.cached_tokens), answers are those of a server without reuse,
/metrics counts the reuse, and a restarted server finds the conversation's KV on the SSD."""

from __future__ import annotations

import pytest

from engine.base.config import EngineConfig
from colibri.commands import serve as serve_command
from colibri_tiny import make_tiny
import test_serve

CTX = 1024
SYSTEM = "You are a careful assistant. " * 12  # well over one 64-token block


def Server(model_dir, prefix_cache: int, kv_dir=None) -> test_serve.Server:
    return test_serve.Server(model_dir, EngineConfig(ctx_size=CTX, prefix_cache=prefix_cache), queue_size=4,
                             kv_dir=kv_dir, kv_disk_bytes=64 << 20 if kv_dir else 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve-prefix") / "tiny")


def conversation(server, turns: int = 3):
    """(answers, usages) of a conversation whose every turn resends the history."""
    client, messages, answers, usages = server.client(), [{"role": "system", "content": SYSTEM}], [], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question number {i}: what comes next?"})
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        answers.append(out.choices[0].message.content)
        usages.append(out.usage)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers, usages


def test_cached_tokens_reported_and_answers_unchanged(tiny):
    plain = Server(tiny, prefix_cache=0)
    try:
        want, plain_usage = conversation(plain)
    finally:
        plain.close()
    assert all(u.prompt_tokens_details.cached_tokens == 0 for u in plain_usage)
    server = Server(tiny, prefix_cache=32 << 20)
    try:
        got, usages = conversation(server)
        assert got == want
        cached = [u.prompt_tokens_details.cached_tokens for u in usages]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:])
        # Each turn reuses at least the previous turn's prompt (the history before it is unchanged).
        assert all(c >= usages[i].prompt_tokens for i, c in enumerate(cached[1:]))
        assert all(c < u.prompt_tokens for c, u in zip(cached, usages))  # the last token is computed
        assert server.metric("colibri_prefix_cached_tokens_total") == sum(cached)
        assert server.metric("colibri_prefix_hits_total") == len(usages) - 1
    finally:
        server.close()


def test_streamed_usage_has_cached_tokens(tiny):
    server = Server(tiny, prefix_cache=32 << 20)
    try:
        client = server.client()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    finally:
        server.close()


def test_a_restarted_server_restores_from_the_kv_dir(tiny, tmp_path):
    first = Server(tiny, prefix_cache=32 << 20, kv_dir=tmp_path)
    try:
        want, _ = conversation(first, turns=2)
    finally:
        first.close()  # its RAM blocks go to the SSD
    assert list(tmp_path.rglob("*.kv.safetensors"))
    second = Server(tiny, prefix_cache=32 << 20, kv_dir=tmp_path)
    try:
        got, usages = conversation(second, turns=2)
        assert got == want
        assert usages[0].prompt_tokens_details.cached_tokens >= 64  # from the files: nothing in RAM yet
        assert second.metric("colibri_kv_disk_read_bytes_total") > 0
        assert second.metric("colibri_kv_restored_bytes_total") > 0  # what the files gave the KV cache
    finally:
        second.close()


def test_blocks_that_leave_a_small_prefix_cache_are_spilled_and_counted(tiny, tmp_path):
    """A prefix cache smaller than one block: the conversation's blocks go to the SSD as they leave
    RAM, and /metrics counts the bytes written and what the directory holds."""
    server = Server(tiny, prefix_cache=1, kv_dir=tmp_path)
    try:
        conversation(server, turns=3)
        assert server.metric("colibri_kv_spilled_bytes_total") > 0
        assert server.metric("colibri_kv_disk_bytes") > 0
    finally:
        server.close()


def test_serve_turns_reuse_on_by_default_and_budget_bounds_it():
    assert serve_command.default_prefix_cache(0) == serve_command.PREFIX_CACHE_DEFAULT
    assert serve_command.default_prefix_cache(512 << 20) == 64 << 20
    assert EngineConfig().prefix_cache == 0  # run and bench measure whole prefills
