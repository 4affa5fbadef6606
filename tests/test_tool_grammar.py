"""Grammar-constrained tool calls without a server (colibri/serve/tools/constrain.py): each format's
grammar, under the real token mask (engine/run/grammar.py) with random logits standing in for a
model, writes calls that the format's own parser reads back and whose arguments validate against
their schemas (jsonschema), for tool_choice required, named and auto with strict functions, with the
markers as plain text and as added tokens; and the refusals: a schema the grammar engine cannot
compile, GLM's key/value syntax's limits, response_format on harmony. The server round trips
through the openai and anthropic clients are in tests/test_serve_tool_grammar.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.api import GrammarTokenizer, load_tokenizer
from colibri.serve.tools import FORMATS, detect_format
from colibri.serve.tools.constrain import Marks, tool_grammar
from colibri.serve.tools.output import ToolOutput, whole
from colibri.serve.tools.request import FieldError, parse_tool_fields

from colibri_tiny import make_tiny
from colibri_tool_models import FAMILIES, FIXTURES, family_model

EOS = 256
STEPS = 400  # far above what the bounded schemas need with parallel_tool_calls false
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
                  "required": ["lat"], "additionalProperties": False}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[A-Z]{3}$"}]},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["zone"], "additionalProperties": False}}}
LOOSE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}  # not strict
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, LOOSE)}
# Text that opens a call in each format, fed before sampling in "auto" (a random model rarely writes it).
OPENERS = {"hermes": "Let me see.<tool_call>", "glm4_moe": "Let me see.\n<tool_call>",
           "deepseek_v3": "Let me see.<｜tool▁calls▁begin｜>",
           "harmony": "<|channel|>analysis<|message|>Look up.<|end|><|start|>assistant<|channel|>commentary to=functions."}
TEMPLATE = {fmt: (FIXTURES / template).read_text() for template, fmt, _ in FAMILIES.values()}
FAMILY = {fmt: family for family, (_, fmt, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tool-grammar") / "tiny")


@pytest.fixture(scope="module")
def tokenizers(tiny, tmp_path_factory):
    """(format, marker_tokens) → (tokenizer, its GrammarTokenizer)."""
    root, out = tmp_path_factory.mktemp("tool-grammar-families"), {}
    for fmt, family in FAMILY.items():
        for as_tokens in (False, True):
            model = family_model(tiny, root / f"{family}-{as_tokens}", family, marker_tokens=as_tokens)
            tok = load_tokenizer(model)
            out[fmt, as_tokens] = tok, GrammarTokenizer(tok, 300, {EOS})
    return out


def sample(tok, gtok, grammar: str, seed: int, prefix: str = "") -> tuple[str, bool]:
    """(text, finished) of one generation under the grammar, random logits for a model."""
    processor, ids = gtok.processor(grammar), []
    for t in tok.encode(prefix, add_special_tokens=False).ids:
        processor(torch.zeros(300), ids)
        processor.accept(t)
        ids.append(t)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        probs = torch.softmax(processor(torch.randn(300, generator=gen) * 3, ids), -1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        if token == EOS:
            return tok.decode(ids, skip_special_tokens=False), True
        processor.accept(token)
        ids.append(token)
        if processor.done():
            return tok.decode(ids, skip_special_tokens=False), True
    return tok.decode(ids, skip_special_tokens=False), False


def request(**fields):
    return parse_tool_fields({"tools": [WEATHER, TIME], "parallel_tool_calls": False, **fields})


def check_calls(fmt: str, req, text: str) -> list:
    content, calls = whole(ToolOutput(detect_format(TEMPLATE[fmt]).new_parser(req.offered()), req), text)
    for call in calls:
        args = json.loads(call.arguments)
        jsonschema.validate(args, SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text-markers", "token-markers"])
@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_forced_calls_always_parse_and_validate(tokenizers, fmt, as_tokens):
    tok, gtok = tokenizers[fmt, as_tokens]
    marks = Marks.of(tok, {EOS})
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        req = request(tool_choice=choice)
        grammar = tool_grammar(detect_format(TEMPLATE[fmt]), req, marks)
        names = set()
        for seed in range(6):
            text, finished = sample(tok, gtok, grammar, seed)
            assert finished, (fmt, choice, text)
            calls = check_calls(fmt, req, text)
            assert len(calls) == 1, (fmt, choice, text)  # parallel_tool_calls false: one
            names.add(calls[0].name)
        assert names == ({"get_time"} if isinstance(choice, dict) else names) and names, (fmt, choice)


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_parallel_forced_calls_each_validate(tokenizers, fmt):
    tok, gtok = tokenizers[fmt, True]
    req = parse_tool_fields({"tools": [WEATHER, TIME], "tool_choice": "required"})
    grammar = tool_grammar(detect_format(TEMPLATE[fmt]), req, Marks.of(tok, {EOS}))
    counts = []
    for seed in range(8):
        text, finished = sample(tok, gtok, grammar, seed)
        if finished:  # a random model may go on calling until the step limit
            counts.append(len(check_calls(fmt, req, text)))
    assert counts and min(counts) >= 1
    # harmony's `<|call|>` ends a turn: one call per turn whatever parallel_tool_calls says
    assert max(counts) == 1 if fmt == "harmony" else max(counts) > 1


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text-markers", "token-markers"])
@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_auto_with_strict_tools_constrains_a_call_once_it_opens(tokenizers, fmt, as_tokens):
    tok, gtok = tokenizers[fmt, as_tokens]
    req = request()
    grammar = tool_grammar(detect_format(TEMPLATE[fmt]), req, Marks.of(tok, {EOS}))
    assert grammar is not None
    for seed in range(6):
        text, finished = sample(tok, gtok, grammar, seed, prefix=OPENERS[fmt])
        assert finished and len(check_calls(fmt, req, text)) == 1, (fmt, text)
    # free text stays free (a random model under the grammar rarely opens a call by itself), and
    # a call it opens validates
    for seed in range(2):
        check_calls(fmt, req, sample(tok, gtok, grammar, seed)[0])


CALLS = {  # a call to `note` in each syntax, with arguments no schema of its own would check
    "hermes": '<tool_call>\n{"name": "note", "arguments": {"x": [1, {"y": null}]}}\n</tool_call>',
    "glm4_moe": "<tool_call>note\n<arg_key>x</arg_key>\n<arg_value>[1]</arg_value>\n</tool_call>",
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>note\n```json\n{"x": [1, {"y": null}]}'
                   "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": '<|channel|>commentary to=functions.note <|constrain|>json<|message|>{"x": [1, {"y": null}]}',
}


@pytest.mark.parametrize("fmt", [f.name for f in FORMATS])
def test_auto_leaves_a_function_that_is_not_strict_any_object(tokenizers, fmt):
    tok, gtok = tokenizers[fmt, True]
    req = parse_tool_fields({"tools": [WEATHER, LOOSE], "parallel_tool_calls": False})
    processor = gtok.processor(tool_grammar(detect_format(TEMPLATE[fmt]), req, Marks.of(tok, {EOS})))
    for token in tok.encode(CALLS[fmt], add_special_tokens=False).ids:
        processor.accept(token)  # raises GrammarError on a token the grammar refuses
    assert processor.done()


def test_auto_without_strict_tools_needs_no_grammar():
    req = parse_tool_fields({"tools": [LOOSE]})
    for fmt in FORMATS:
        assert tool_grammar(fmt, req, Marks({}, {EOS})) is None


def test_marks_name_the_tokens_llguidance_holds_special(tokenizers):
    tok, gtok = tokenizers["harmony", True]
    marks = Marks.of(tok, {EOS})
    special = {i for i in range(300) if gtok.lltokenizer.is_special_token(i)}
    assert set(marks.added.values()) <= special and set(marks.added.values()) == special - {255}  # 255: byte 0xFF
    assert marks("<|channel|>").startswith("<[") and marks("to=functions.") == '"to=functions."'
    text_tok, _ = tokenizers["harmony", False]
    assert Marks.of(text_tok, {EOS})("<|channel|>") == '"<|channel|>"'


@pytest.mark.parametrize("schema, construct", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, '"not"'),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}, "no-such-format"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
])
def test_a_schema_the_engine_cannot_compile_is_refused_naming_the_construct(schema, construct):
    bad = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for fields in ({"tool_choice": "required"}, {"tools": [WEATHER, {**bad, "function": {**bad["function"],
                                                                                          "strict": True}}]}):
        req = parse_tool_fields({"tools": [WEATHER, bad], **fields})
        with pytest.raises(FieldError) as err:
            tool_grammar(FORMATS[-1], req, Marks({}, {EOS}))
        assert err.value.param == "tools[1].function.parameters" and construct in err.value.message


def test_glm_refuses_what_its_key_value_syntax_cannot_say():
    glm = detect_format(TEMPLATE["glm4_moe"])
    for schema, word in (({"type": "object", "anyOf": [{"required": ["a"]}]}, "anyOf"),
                         ({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}, "format")):
        req = parse_tool_fields({"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                 "tool_choice": "required"})
        with pytest.raises(FieldError) as err:
            tool_grammar(glm, req, Marks({}, {EOS}))
        assert err.value.param == "tools" and word in err.value.message and "'f'" in err.value.message


def test_response_format_with_tools(tokenizers):
    """auto with a response_format: the content is the response schema's JSON, or the answer is
    calls; harmony's content is a channel's message, so the pair is refused there."""
    tok, gtok = tokenizers["hermes", False]
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    req = parse_tool_fields({"tools": [WEATHER, TIME]})
    grammar = tool_grammar(detect_format(TEMPLATE["hermes"]), req, Marks.of(tok, {EOS}), answer)
    for seed in range(4):
        text, finished = sample(tok, gtok, grammar, seed)
        assert finished
        if not text.startswith("<tool_call>"):
            assert json.loads(text) in ({"ok": True}, {"ok": False})
        else:
            assert len(check_calls("hermes", req, text)) == 1
    with pytest.raises(FieldError) as err:
        tool_grammar(detect_format(TEMPLATE["harmony"]), req, Marks({}, {EOS}), answer)
    assert err.value.param == "response_format"
