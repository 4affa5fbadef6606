"""Tool calling without a server (issue 40 items 1 and 5): each family's chat template renders tools
and a tool history as transformers does, the format is detected from the template, each parser
reads its format's calls (whole and cut into any pieces alike), tool_choice / parallel_tool_calls
rules, and the streamed chunks and Anthropic events read back through the official clients' own
stream accumulators. The server round trips are in tests/test_serve_tools_e2e.py."""

from __future__ import annotations

import json

import pytest

from colibri.serve.anthropic import EventMaker, parse_messages
from colibri.serve.chat_template import ChatTemplate
from colibri.serve.protocol import ApiError, parse_chat
from colibri.serve.tools import detect_format
from colibri.serve.tools.chat import ChunkMaker
from colibri.serve.tools.output import ToolOutput, whole
from colibri.serve.tools.request import parse_tool_fields

from colibri_tiny import make_tiny
from colibri_tool_models import FAMILIES, FIXTURES, TOOLS, family_model, history

# Each family's answer with two parallel calls and some content, in the family's own syntax.
ANSWERS = {
    "hermes": 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>',
    "deepseek_v3": "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                   'get_time\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm4_moe": "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
                "<tool_call>get_time<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    # harmony: reasoning (hidden), a preamble (content), then one call per message; <|call|> is an
    # end-of-sequence token the worker stops at, so the last call has none.
    "harmony": "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>commentary<|message|>"
               "Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
               '<|message|>{"city": "Paris", "days": 2}<|call|><|start|>assistant to=functions.get_time'
               '<|channel|>commentary json<|message|>{"city": "Rome"}',
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"city": "Rome"})]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-models")
    tiny = make_tiny(root / "tiny")
    return {family: family_model(tiny, root / family, family) for family in FAMILIES}


FORMAT_TEMPLATE = {fmt: (FIXTURES / template).read_text() for template, fmt, _ in FAMILIES.values()}


def output(fmt: str, **fields) -> ToolOutput:
    """A request's answer reader for a format, the parser chosen from the family's template."""
    request = parse_tool_fields({"tools": TOOLS, **fields})
    return ToolOutput(detect_format(FORMAT_TEMPLATE[fmt]).new_parser(request.offered()), request)


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_format_is_read_from_the_template(family):
    fmt = FAMILIES[family][1]
    assert detect_format(FORMAT_TEMPLATE[fmt]).name == fmt
    assert detect_format(None) is None  # ChatML, the fallback: no tool format
    assert detect_format("{{ '<tool_call>' }}<function=x>") is None  # Qwen3-Coder's XML: not parsed here


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_tool_history_render_as_transformers_does(models, family):
    transformers = pytest.importorskip("transformers")
    req = parse_chat({"messages": history(), "tools": TOOLS})
    ours = ChatTemplate.for_model(models[family]).render(req.messages, tools=req.tools.offered())
    # What a transformers user passes: arguments as a dict, except to DeepSeek's published
    # template, which concatenates them as the JSON text.
    messages = history()
    call = messages[2]["tool_calls"][0]["function"]
    if family != "deepseek_v3":
        call["arguments"] = json.loads(call["arguments"])
    messages[3]["name"] = "get_weather"  # the server names a result by its call's id
    oracle = transformers.PreTrainedTokenizerFast.from_pretrained(str(models[family]))
    assert ours == oracle.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"Paris"' in ours or ">Paris<" in ours  # the call went into the prompt
    assert '"sky": "clear"' in ours or '\\"sky\\"' in ours  # and so did its result


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rendered_call_parses_back_to_itself(models, family):
    """The syntax the template renders a past call in is the syntax the parser reads: parsing the
    whole rendered prompt finds that call (and no call in the tools' instructions)."""
    req = parse_chat({"messages": history(), "tools": TOOLS})
    prompt = ChatTemplate.for_model(models[family]).render(req.messages, tools=req.tools.offered())
    out = output(FAMILIES[family][1])
    _, calls = whole(out, prompt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [EXPECTED[0]]


@pytest.mark.parametrize("fmt", ANSWERS)
@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_each_format_parses_parallel_calls_whole_and_streamed(fmt, size):
    out = output(fmt)
    events = [e for p in pieces(ANSWERS[fmt], size) for e in out.feed(p)] + out.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [(v.name, json.loads(v.arguments)) for k, v in events if k in ("call", "call_end")]
    assert calls == EXPECTED
    if fmt != "glm4_moe":  # a call begins at its head, its arguments come as they are written
        assert [k for k, _ in events if k.startswith("call")][0] == "call_begin"
        for _, call in (e for e in events if e[0] == "call_end"):
            streamed = [p for k, v in events if k == "call_args" and v[0] is call for p in v[1:]]
            assert "".join(streamed) == call.arguments
            if size == 1:  # every character as it came
                assert len(streamed) == len(call.arguments)
            assert (len(streamed) > 1) == (size < len(call.arguments))

    assert content == "Let me check."
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    assert whole(output(fmt), ANSWERS[fmt])[0] == content


@pytest.mark.parametrize("fmt", ANSWERS)
def test_text_without_calls_is_content_unchanged(fmt):
    text = "a < b, <tool and { not a call } \n"
    if fmt == "harmony":
        content, calls = whole(output(fmt), "<|channel|>final<|message|>" + text)
    else:
        content, calls = whole(output(fmt), text)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("fmt, broken", [
    ("glm4_moe", "<tool_call>{function-name}\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": }\n</tool_call>'),
    ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```yaml\ncity: Paris\n```<｜tool▁call▁end｜>"),
    ("harmony", "<|channel|>commentary to=functions.get_weather<|message|>city=Paris"),
])
def test_a_call_that_does_not_parse_is_given_back_as_content(fmt, broken):
    content, calls = whole(output(fmt), broken)
    assert calls == [] and content == (broken if fmt != "harmony" else broken.split("<|message|>")[0] + "<|message|>"
                                       + "city=Paris")


@pytest.mark.parametrize("fmt, begun, arguments", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', '{"city": '),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),  # cut by max_tokens
    ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{oops\n```<｜tool▁call▁end｜>",
     "{oops\n```"),
    ("harmony", "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": ", '{"city": '),
])
def test_a_call_whose_head_was_read_stays_a_call_with_the_models_text(fmt, begun, arguments):
    """Its arguments were streamed as they came, so it cannot become content at its end: like
    OpenAI's own calls without strict, its arguments are the model's text, valid JSON or not.
    Anthropic's tool_use input is an object, so there it is given back as text."""
    content, calls = whole(output(fmt), begun)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)]
    assert content is None and begun.startswith(calls[0].raw)
    from colibri.serve.anthropic import blocks
    assert blocks(content, calls) == [{"type": "text", "text": calls[0].raw}]


def test_parallel_false_keeps_the_first_call_and_a_named_choice_only_its_function():
    _, calls = whole(output("hermes", parallel_tool_calls=False), ANSWERS["hermes"])
    assert [c.name for c in calls] == ["get_weather"]
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls = whole(output("hermes", tool_choice=named), ANSWERS["hermes"])
    assert [c.name for c in calls] == ["get_time"]
    assert '"get_weather"' in content  # the call to another function is text, not dropped


def test_required_without_a_call_answers_the_text_with_stop():
    out = output("hermes", tool_choice="required")
    assert whole(out, "I will not call.") == ("I will not call.", [])
    assert out.finish_reason("stop") == "stop"


def test_a_named_choice_shows_the_model_that_function_alone():
    req = parse_tool_fields({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert [t["function"]["name"] for t in req.offered()] == ["get_time"]
    assert parse_tool_fields({"tools": TOOLS, "tool_choice": "none"}).offered() is None


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
])
def test_bad_tool_fields_are_refused_by_name(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.status == 400 and e.value.param == param


def test_streamed_chunks_read_back_through_the_openai_client():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    out, maker = output("hermes"), ChunkMaker("chatcmpl-1", "tiny")
    chunks = [maker.opening()] + [c for p in pieces(ANSWERS["hermes"], 4) for c in maker.events(out.feed(p))]
    chunks += maker.events(out.finish()) + [maker.chunk({}, out.finish_reason("stop"))]
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    calls = final.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


@pytest.mark.parametrize("fmt", ["glm4_moe", "hermes"])  # a call whole at its end, and one that streams
def test_anthropic_events_read_back_through_the_anthropic_client(fmt):
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    out, maker = output(fmt), EventMaker("msg_1", "tiny", 12)
    events = maker.start() + [e for p in pieces(ANSWERS[fmt], 5) for e in maker.events(out.feed(p))]
    events += maker.events(out.finish()) + maker.end("tool_use", None, 30)
    adapter, snapshot, bufs = TypeAdapter(RawMessageStreamEvent), None, {}
    for name, data in events:
        assert data["type"] == name
        snapshot = accumulate_event(event=adapter.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 30
    assert snapshot.content[0].type == "text" and snapshot.content[0].text == "Let me check."
    assert [(b.name, b.input) for b in snapshot.content[1:]] == EXPECTED
    assert all(b.id.startswith("toolu_") for b in snapshot.content[1:])


def test_anthropic_requests_become_chat_requests():
    req = parse_messages({
        "model": "claude-anything", "max_tokens": 20, "system": [{"type": "text", "text": "Be terse."}],
        "stop_sequences": ["END"], "temperature": 0.5,
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "sunny"}]}]}]})
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert str(req.messages[2]["tool_calls"][0]["function"]["arguments"]) == '{"city": "Paris"}'
    assert req.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny", "name": "get_weather"}
    assert (req.tools.choice, req.tools.parallel) == ("required", False)
    assert req.sampling.stop == ["END"] and req.sampling.max_tokens == 20


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_k": 5}, "top_k"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages[1].role"),
])
def test_bad_anthropic_fields_are_refused_by_their_anthropic_names(body, param):
    with pytest.raises(ApiError) as e:
        parse_messages(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param)
