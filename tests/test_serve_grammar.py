"""Structured output (`response_format`) through the official `openai` client against `colibri serve` on
a tiny random model: every json_schema answer parses and validates over many seeded samples at
temperature 1, streamed and not, on both routes; json_object answers parse; a schema the grammar
engine cannot compile is a 400 naming the construct; the generate loop's processor hook
(engine/run/grammar.py's contract) on its own; and the mask on the drafted path (speculative
decoding: greedy the same tokens as without drafts, sampled answers valid). The batched path:
tests/test_serve_batch.py.

A random model under the mask still writes grammar-valid output; the schemas bound every string and
array (maxLength, maxItems) so that each answer completes well within max_tokens."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.run.grammar import GrammarError, GrammarTokenizer, json_grammar
from engine.run.runtime import Engine
from engine.synth.geometry import EOS_TOKEN_ID
from engine.run.generate import load_tokenizer

from colibri_tiny import make_tiny
from test_serve import Server

SEEDS = range(8)
MAX_TOKENS = 1200  # far above what the bounded schemas need: an answer that ends "length" is a failure

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "level": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9},
                                    {"type": "object", "properties": {"note": {"type": "string", "maxLength": 8}},
                                     "required": ["note"], "additionalProperties": False}]},
            },
            "required": ["ok", "level"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "count", "kind", "tags", "inner"],
    "additionalProperties": False,
}
LIST_OF_RECORDS = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/item"}},
        "total": {"type": "number", "minimum": -1000, "maximum": 1000},
        "unit": {"const": "kg"},
    },
    "required": ["items", "total", "unit"],
    "additionalProperties": False,
    "$defs": {"item": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
        "state": {"enum": ["new", "used", None]}},
        "required": ["id", "qty", "state"], "additionalProperties": False}},
}
SCHEMAS = {"nested": NESTED, "records": LIST_OF_RECORDS}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("grammar") / "tiny")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny, queue_size=4)
    yield s
    s.close()


def _json_schema(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def _chat(client, response_format, seed, max_tokens=MAX_TOKENS, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer in JSON."}],
                                          max_tokens=max_tokens, temperature=1, seed=seed,
                                          response_format=response_format, **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_always_parse_and_validate(server, name):
    schema, client = SCHEMAS[name], server.client()
    answers = set()
    for seed in SEEDS:
        out = _chat(client, _json_schema(schema, strict=seed % 2 == 0), seed)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        answers.add(choice.message.content)
    assert len(answers) > 1, "different seeds sampled the same answer: the sampler is not sampling"


def test_streamed_answers_are_the_whole_ones_and_validate(server):
    client = server.client()
    for seed in range(3):
        whole = _chat(client, _json_schema(NESTED), seed)
        chunks = list(_chat(client, _json_schema(NESTED), seed, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        jsonschema.validate(json.loads(text), NESTED)


def test_completions_route_takes_response_format_too(server):
    client = server.client()
    for seed in range(4):
        out = client.completions.create(model="tiny", prompt="JSON:", max_tokens=MAX_TOKENS, temperature=1, seed=seed,
                                        extra_body={"response_format": _json_schema(LIST_OF_RECORDS)})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].text), LIST_OF_RECORDS)


def test_json_object_answers_parse(server):
    # Any object: keys and strings are unbounded, so a random model may run to max_tokens (an
    # unfinished document, as the docs say); every answer that ends "stop" is one JSON object.
    client, finished = server.client(), 0
    for seed in SEEDS:
        out = _chat(client, {"type": "json_object"}, seed)
        choice = out.choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
    assert finished >= len(SEEDS) // 2


def test_length_ends_with_an_unfinished_document(server):
    out = _chat(server.client(), _json_schema(NESTED), 0, max_tokens=4)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.choices[0].message.content)


def test_type_text_is_free_text(server):
    out = _chat(server.client(), {"type": "text"}, 0, max_tokens=6)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("schema, construct", [
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if"'),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"$ref": "https://example.com/remote.json"}, "https://example.com/remote.json"),
])
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_construct(server, schema, construct):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, _json_schema(schema), 0)
    assert construct in err.value.message
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as err:  # the completions route refuses it alike
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"response_format": _json_schema(schema)})
    assert construct in err.value.message


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": True}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
])
def test_malformed_response_formats_are_refused_by_field(server, response_format, param):
    with pytest.raises(openai.BadRequestError) as err:
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, extra_body={"response_format": response_format})
    assert err.value.body["param"] == param


# The hook in the generate loop, without HTTP.

class _Force:
    """A processor that allows one token only and is done after `n` of them."""

    def __init__(self, token: int, n: int):
        self.token, self.n, self.seen, self.calls = token, n, [], 0

    def __call__(self, logits, generated):
        assert logits.dtype == torch.float32 and generated == self.seen
        self.calls += 1
        out = torch.full_like(logits, float("-inf"))
        out[self.token] = 0.0
        return out

    def accept(self, token):
        self.seen.append(token)

    def done(self):
        return len(self.seen) >= self.n


def test_generate_applies_processors_and_stops_when_they_are_done(tiny):
    engine = Engine(tiny, EngineConfig(ctx_size=64))
    try:
        force = _Force(token=42, n=3)
        gen = generate(engine, [1, 2, 3], 20, Sampler(temperature=1.0, seed=5), processors=[force])
        assert gen.output_ids == [42, 42, 42] and force.calls == 3
        # A grammar: greedy output under the mask is the schema's document, and done() ends it
        # without an end-of-sequence token.
        tokenizer = load_tokenizer(tiny)
        schema = {"type": "object", "properties": {"k": {"enum": ["yes", "no"]}}, "required": ["k"],
                  "additionalProperties": False}
        grammar = GrammarTokenizer(tokenizer, engine.args.vocab_size, {EOS_TOKEN_ID}).processor(json_grammar(schema))
        gen = generate(engine, [1, 2, 3], 40, Sampler(), processors=[grammar])
        text = tokenizer.decode(gen.output_ids)
        assert json.loads(text) in ({"k": "yes"}, {"k": "no"}) and grammar.done()
        assert EOS_TOKEN_ID not in gen.output_ids
    finally:
        engine.close()


def test_the_mask_is_minus_infinity_outside_the_grammar(tiny):
    tokenizer = load_tokenizer(tiny)
    vocab = tokenizer.get_vocab_size() + 20  # a model's embedding padded past the tokenizer
    processor = GrammarTokenizer(tokenizer, vocab, {EOS_TOKEN_ID}).processor(json_grammar(None))
    masked = processor(torch.zeros(vocab), [])
    allowed = torch.isfinite(masked).nonzero().flatten().tolist()
    assert [tokenizer.decode([t]) for t in allowed] == ["{"]  # compact JSON: an object opens with "{"
    with pytest.raises(GrammarError):
        processor.accept(tokenizer.token_to_id("x"))


def test_json_grammar_refuses_a_non_object_schema():
    with pytest.raises(GrammarError):
        json_grammar([{"type": "string"}])


def test_the_mask_holds_on_the_drafted_path(tiny):
    """Speculative decoding with a grammar: a drafted token the mask bans is rejected, and the
    grammar's state advances only by the tokens emitted (greedy: the tokens of the plain path)."""
    tokenizer = load_tokenizer(tiny)
    doc = '{"name": "ab", "count": 1, "kind": "alpha", "tags": ["a"], "inner": {"ok": true, "level": null}}'
    prompt = tokenizer.encode(f"{doc} {doc} Again:").ids  # n-grams the lookup drafter proposes from
    with Engine(tiny, EngineConfig(ctx_size=1024, threads=1)) as engine:
        grammar = GrammarTokenizer(tokenizer, engine.args.vocab_size, {EOS_TOKEN_ID})
        want = generate(engine, prompt, 300, Sampler(), processors=[grammar.processor(json_grammar(NESTED))])
    with Engine(tiny, EngineConfig(ctx_size=1024, threads=1, draft="fixed", drafter="lookup")) as engine:
        got = generate(engine, prompt, 300, Sampler(), processors=[grammar.processor(json_grammar(NESTED))])
        assert got.output_ids == want.output_ids
        jsonschema.validate(json.loads(tokenizer.decode(got.output_ids)), NESTED)
        for seed in range(3):
            gen = generate(engine, prompt, 800, Sampler(temperature=1.0, seed=seed),
                           processors=[grammar.processor(json_grammar(NESTED))])
            assert gen.stopped_by_processor, seed
            jsonschema.validate(json.loads(tokenizer.decode(gen.output_ids)), NESTED)
        stats = engine.speculator.stats
        assert stats.drafted > 0 and stats.accepted < stats.drafted  # drafts came, and the mask refused some
