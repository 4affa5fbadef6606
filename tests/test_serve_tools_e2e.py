"""Tool calling and /v1/messages against a real `colibri serve` on tiny models carrying the families'
chat templates, through the official `openai` and `anthropic` clients: a round trip (the call
and the tool's result sent back, the final answer) streamed and not, tool_choice variants, and
errors. A tiny random model does not write calls by itself, so what the server did with the tools
and history is checked where it shows: the prompt's token count (usage) equals the family's
template rendered here with the same tools and history; the parsers are tested on known answers in
tests/test_serve_tools.py."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from engine.api import load_tokenizer
from colibri.serve.chat_template import ChatTemplate
from colibri.serve.protocol import parse_chat

from colibri_tiny import make_tiny
from colibri_tool_models import FAMILIES, TOOLS, family_model, history
from test_serve import Server


# The anthropic client (2.x) no longer has a `temperature` argument; the API still takes the field.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tools-e2e") / "tiny")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tiny, tmp_path_factory):
    model = family_model(tiny, tmp_path_factory.mktemp("fam") / request.param, request.param)
    s = Server(model, queue_size=4, model_name="tiny")
    yield request.param, model, s
    s.close()


def prompt_tokens(model, body: dict, tools=None) -> int:
    req = parse_chat(body)
    text = ChatTemplate.for_model(model).render(req.messages, add_generation_prompt=True, tools=tools)
    return len(load_tokenizer(model).encode(text, add_special_tokens=False).ids)


def test_round_trip_whole_and_streamed(family_server):
    family, model, server = family_server
    client = server.client()
    first = [{"role": "user", "content": "Weather in Paris?"}]
    # 1. the question with tools: an answer the client can read (content or calls)
    r = client.chat.completions.create(model="tiny", messages=first, tools=TOOLS, max_tokens=6, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert isinstance(choice.message.content, str) or choice.message.tool_calls
    assert r.usage.prompt_tokens == prompt_tokens(model, {"messages": first}, TOOLS)
    # 2. the call and the tool's result sent back: rendered into the prompt, the final answer comes
    for stream in (False, True):
        body = {"messages": history()}
        if stream:
            chunks = list(client.chat.completions.create(model="tiny", messages=history(), tools=TOOLS, max_tokens=6,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            assert chunks[0].choices[0].delta.role == "assistant"
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(finishes) == 1 and finishes[0] in ("stop", "length", "tool_calls")
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(model="tiny", messages=history(), tools=TOOLS, max_tokens=6,
                                                   temperature=0).usage
        assert usage.prompt_tokens == prompt_tokens(model, body, TOOLS), family


def test_tool_choice_variants_render_what_they_offer(family_server):
    family, model, server = family_server
    client = server.client()
    msgs = [{"role": "user", "content": "Time in Rome?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, offered in (("auto", TOOLS), ("required", TOOLS), ("none", None), (named, [TOOLS[1]])):
        r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == prompt_tokens(model, {"messages": msgs}, offered), (family, choice)
        assert len(r.choices[0].message.tool_calls or []) <= 1  # parallel_tool_calls false
        if r.choices[0].message.tool_calls is None:
            assert r.choices[0].finish_reason in ("stop", "length")


def test_anthropic_round_trip_whole_and_streamed(family_server):
    family, model, server = family_server
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                   "input": {"city": "Paris", "days": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                              "content": '{"sky": "clear", "high": 21}'}]}]
    whole = client.messages.create(model="any-name", max_tokens=6, system="You are terse.", messages=messages,
                                   tools=tools, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The same conversation in OpenAI's shape renders to the same prompt.
    assert whole.usage.input_tokens == prompt_tokens(model, {"messages": history()}, TOOLS)
    with client.messages.stream(model="any-name", max_tokens=6, system="You are terse.", messages=messages,
                                tools=tools, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    count = client.messages.count_tokens(model="x", system="You are terse.", messages=messages, tools=tools)
    assert count.input_tokens == whole.usage.input_tokens


def test_anthropic_text_stop_sequences_and_errors(tiny):
    s = Server(tiny, api_key="k3y")
    try:
        client = anthropic.Anthropic(base_url=s.base, api_key="k3y", max_retries=0, timeout=60)
        whole = client.messages.create(model="m", max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
                                       extra_body=GREEDY)
        text = "".join(b.text for b in whole.content)
        with client.messages.stream(model="m", max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
                                    extra_body=GREEDY) as stream:
            assert "".join(stream.text_stream) == text
        assert whole.stop_reason in ("end_turn", "max_tokens")
        cut = next((text[i:i + 2] for i in range(1, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2]
                    and text.find(text[i:i + 2]) == i), None)
        if cut:
            stopped = client.messages.create(model="m", max_tokens=12, stop_sequences=[cut], extra_body=GREEDY,
                                             messages=[{"role": "user", "content": "Hi"}])
            assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", cut)
            assert "".join(b.text for b in stopped.content) == text[:text.find(cut)]
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.base, api_key="wrong", max_retries=0).messages.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(s.base + "/v1/messages", headers={"x-api-key": "k3y"},
                       json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens: is required"}}
        # The ChatML fallback has no tool format: tools are refused by name, not ignored.
        r = httpx.post(s.base + "/v1/chat/completions", headers={"Authorization": "Bearer k3y"},
                       json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    finally:
        s.close()

