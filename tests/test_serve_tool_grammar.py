"""Grammar-constrained tool calls against a real `colibri serve`, through the official `openai` and
`anthropic` clients, on tiny random models carrying each family's chat template with its markers as
added tokens (as the real vocabularies hold them): with tool_choice required or named, every
answer over many seeded samples at temperature 1 is calls that parse and whose arguments validate
(jsonschema), streamed and whole alike; auto with strict functions constrains a call once it opens
(a logit bias on the opening marker makes the random model open one); a schema the grammar engine
cannot compile is a 400 naming the construct; parallel calls, indexed, whole and streamed; a full
round trip from the model's own call (call, the tool's result sent back, the final answer), streamed
and not; the log-probs of a calling answer, whole and streamed, are the model's own softmax over
every token it wrote (markers included), recomputed here through a second engine. The grammars
themselves: tests/test_tool_grammar.py."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import torch

from engine.api import load_tokenizer
from engine.base.config import EngineConfig
from engine.run.runtime import Engine
from colibri.serve.protocol import parse_chat

from colibri_tiny import make_tiny
from colibri_tool_models import FAMILIES, family_model
from test_serve import CTX, Server

SEEDS = range(6)
MAX_TOKENS = 400  # far above what the bounded schemas need: an answer that ends "length" is a failure
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "strict": True, "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "strict": True,
                                         "parameters": {
    "type": "object", "properties": {"zone": {"anyOf": [{"type": "null"}, {"enum": ["UTC", "CET"]}]},
                                     "utc": {"type": "boolean"}},
    "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
OPENER = {"qwen3": "<tool_call>", "glm4_moe": "<tool_call>", "deepseek_v3": "<｜tool▁calls▁begin｜>"}
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tool-grammar-serve") / "tiny")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_server(request, tiny, tmp_path_factory):
    model = family_model(tiny, tmp_path_factory.mktemp("fam") / request.param, request.param, marker_tokens=True)
    s = Server(model, queue_size=4, model_name="tiny")
    yield request.param, model, s
    s.close()


def validated(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_and_named_calls_always_parse_and_validate(family_server):
    family, _model, server = family_server
    client = server.client()
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        answers = set()
        for seed in SEEDS:
            r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1,
                                               seed=seed)
            choice0 = r.choices[0]
            assert choice0.finish_reason == "tool_calls", (family, choice, choice0.message)
            assert choice0.message.content is None
            calls = validated(choice0.message.tool_calls)
            assert len(calls) == 1
            if choice == named:
                assert calls[0][0] == "get_time"
            answers.add(json.dumps(calls))
        assert len(answers) > 1, "different seeds sampled the same call: the sampler is not sampling"


def test_streamed_forced_calls_are_the_whole_ones(family_server):
    family, _model, server = family_server
    client = server.client()
    for seed in range(2):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=MAX_TOKENS, temperature=1, seed=seed)
        whole = client.chat.completions.create(**kw)
        with client.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
        got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
        assert got == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        validated(final.choices[0].message.tool_calls)


def test_auto_with_strict_tools_constrains_the_call_it_opens(family_server):
    family, model, server = family_server
    if family not in OPENER:
        pytest.skip("harmony opens a call with text (`to=functions.`), which a logit bias cannot force; "
                    "tests/test_tool_grammar.py feeds it")
    opener = load_tokenizer(model).token_to_id(OPENER[family])
    client = server.client()
    for seed in SEEDS:
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                           max_tokens=MAX_TOKENS, temperature=1, seed=seed,
                                           logit_bias={str(opener): 100})
        assert r.choices[0].finish_reason == "tool_calls", (family, r.choices[0].message)
        assert len(validated(r.choices[0].message.tool_calls)) == 1


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_construct(family_server):
    _family, _model, server = family_server
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, bad], max_tokens=8)
    assert err.value.body["param"] == "tools[1].function.parameters" and '"not"' in err.value.message
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=8, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "f", "input_schema": bad["function"]["parameters"]}])
    assert err.value.body["error"]["message"].startswith("tools[0].input_schema:") and '"not"' in err.value.message


def test_anthropic_any_and_named_tool_use_validates(family_server):
    family, _model, server = family_server
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    # one call each (Anthropic's API has no seed: with parallel calls a random model may write
    # calls until max_tokens)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        for _ in range(3):
            msg = client.messages.create(model="m", max_tokens=MAX_TOKENS, messages=ASK, tools=tools,
                                         tool_choice={**choice, "disable_parallel_tool_use": True},
                                         extra_body={"temperature": 1})
            assert msg.stop_reason == "tool_use", (family, msg.content)
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert len(uses) == 1
            jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
            assert choice["type"] == "any" or uses[0].name == "get_weather"


def test_response_format_with_tools_is_its_json_or_calls(family_server):
    family, _model, server = family_server
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    client = server.client()
    if family == "gpt_oss":  # its content is a channel's message: refused by name, not ignored
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, response_format=fmt, max_tokens=8)
        assert err.value.body["param"] == "response_format"
        return
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, response_format=fmt,
                                           parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1, seed=seed)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls" and len(validated(message.tool_calls)) == 1
        else:
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(message.content), answer)


def test_arguments_stream_as_they_are_generated(family_server):
    """OpenAI sends a call's `function.arguments` in pieces as the model writes them: the name
    first, then the arguments' text across many chunks (GLM's key/value pairs are JSON only once the
    call is whole, so its arguments come in one piece)."""
    family, _model, server = family_server
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=MAX_TOKENS, temperature=1, seed=3, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name in SCHEMAS and deltas[0].id and deltas[0].function.arguments == ""
    pieces = [d.function.arguments for d in deltas[1:]]
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])
    arguments = "".join(pieces)
    jsonschema.validate(json.loads(arguments), SCHEMAS[deltas[0].function.name])
    if family == "glm4_moe":
        assert len(pieces) == 1
    else:
        assert len(pieces) > 3, pieces  # one per token or so, not the whole at the end


def test_an_unseeded_answer_with_tools_names_its_seed_and_replays(family_server):
    _family, _model, server = family_server
    client = server.client()
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=MAX_TOKENS, temperature=1)
    raw = client.chat.completions.with_raw_response.create(**kw)
    first = raw.parse()
    seed = int(raw.headers["x-colibri-seed"])
    assert first.to_dict()["seed"] == seed
    again = client.chat.completions.create(**kw, seed=seed)
    assert [(c.function.name, c.function.arguments) for c in again.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in first.choices[0].message.tool_calls]


@pytest.fixture(scope="module")
def oracle(tiny):
    """A second engine on the tiny model's weights (every family's copy has the same): the test's own logits."""
    with Engine(tiny, EngineConfig(ctx_size=CTX, threads=1)) as engine:
        yield engine


def test_logprobs_of_a_calling_answer_are_the_models_softmax(family_server, oracle):
    """logprobs with tools: one entry per generated token of the call (its markers and syntax too),
    each the log-softmax of the model's raw logits after the prompt and the tokens before it (the
    grammar's mask and temperature 1 change what is drawn, not what is reported), with the top
    alternatives; streamed, the same entries across the chunks, none twice."""
    family, _model, server = family_server
    state = server.state
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=MAX_TOKENS, temperature=1, seed=4, logprobs=True, top_logprobs=3)
    whole = server.client().chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    name = whole.choices[0].message.tool_calls[0].function.name
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 5
    written = b"".join(bytes(c.bytes) for c in content).decode("utf-8")
    assert name in written, (family, written)
    ids_of: dict[bytes, list[int]] = {}
    for i in range(oracle.args.vocab_size):
        ids_of.setdefault(state.token_text.get(i)[0], []).append(i)
    prompt = state.template.render(ASK, add_generation_prompt=True, tools=TOOLS)
    ids = state.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert len(ids) == whole.usage.prompt_tokens
    for c in content:
        lp = torch.log_softmax(oracle.forward(ids, 0, last_only=True)[-1].float(), dim=-1)
        drawn = [i for i in ids_of[bytes(c.bytes)] if abs(float(lp[i]) - c.logprob) < 1e-4]
        assert drawn, (family, c.token, c.logprob)
        top = torch.topk(lp, 3)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [bytes(t.bytes) for t in c.top_logprobs] == [state.token_text.get(i)[0] for i in top.indices.tolist()]
        ids.append(drawn[0])

    chunks = list(server.client().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]
    assert chunks[-1].usage.completion_tokens == len(streamed)
    # entries ride on the chunks that carry the call (its head, its arguments) and the finish chunk
    carriers = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert all(c.delta.tool_calls or c.finish_reason for c in carriers), family


def test_parallel_calls_come_back_as_indexed_tool_calls(family_server):
    """parallel_tool_calls (the default) with tool_choice required: a random model writes one call or
    several, each validating, with its own id; streamed, each call has its own index and the deltas
    assemble to the whole answer's calls. Harmony's `<|call|>` ends a turn: one call per answer."""
    family, _model, server = family_server
    client = server.client()
    several = None
    for seed in range(3 if family == "gpt_oss" else 8):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS,
                  temperature=1, seed=seed)
        whole = client.chat.completions.create(**kw)
        if whole.choices[0].finish_reason == "length":  # a random model may go on calling
            continue
        assert whole.choices[0].finish_reason == "tool_calls", (family, whole.choices[0].message)
        calls = whole.choices[0].message.tool_calls
        validated(calls)
        assert len({c.id for c in calls}) == len(calls)
        if family == "gpt_oss":
            assert len(calls) == 1
        elif len(calls) > 1:
            several = kw, calls
            break
    if family == "gpt_oss":
        return
    assert several, f"{family}: no answer of several calls in 8 seeds"
    kw, calls = several
    chunks = list(client.chat.completions.create(**kw, stream=True))
    heads = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
    assert [d.index for d in heads] == list(range(len(calls)))
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_a_round_trip_from_the_models_own_call(family_server):
    """The whole loop an agent runs, streamed and not: the model's call (forced, so a random model
    writes one), the message sent back as the client gives it (model_dump) with the tool's result,
    and the final answer, whose prompt is the family's template over that history (the call and the
    result reached the model: the server's prompt token count is that render's)."""
    family, model, server = family_server
    client = server.client()
    tokenizer = load_tokenizer(model)
    for stream in (False, True):
        kw = dict(model="tiny", tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1, seed=1)
        messages = list(ASK)
        if stream:
            with client.chat.completions.stream(messages=messages, tool_choice="required", **kw) as s:
                first = s.get_final_completion()
        else:
            first = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls, family
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"call": call.function.name, "result": "clear skies"})})
        final_kw = dict(messages=messages, tool_choice="none", **{**kw, "max_tokens": 6})
        if stream:
            chunks = list(client.chat.completions.create(**final_kw, stream=True,
                                                         stream_options={"include_usage": True}))
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish in (["stop"], ["length"])
            used = chunks[-1].usage.prompt_tokens
        else:
            final = client.chat.completions.create(**final_kw)
            assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
            used = final.usage.prompt_tokens
        history = parse_chat({"messages": messages}).messages
        rendered = server.state.template.render(history, add_generation_prompt=True)  # tool_choice none: no tools
        assert "clear skies" in rendered and all(c.function.name in rendered for c in message.tool_calls)
        assert used == len(tokenizer.encode(rendered, add_special_tokens=False).ids), (family, stream)
