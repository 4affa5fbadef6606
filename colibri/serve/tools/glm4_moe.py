"""GLM-4.5 / GLM-4.6 / GLM-4.7 / GLM-5 calls: the function name, then each argument as a key/value
pair of tags (GLM-4.5 puts newlines between them, GLM-4.7 and 5 do not):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The template writes a string value as is and anything else as JSON (`v | tojson if v is not
string else v`), so a value is read back by the parameter's schema: a string parameter keeps the
raw text, any other is JSON when it parses (`42` is a number, `[1]` a list), text otherwise.

Constrained (colibri/serve/tools/constrain.py), the arguments are the schema's top-level
properties in order, required ones always, as key/value pairs: a string parameter's raw text under
its enum, const, length and pattern, any other parameter's JSON under its schema. The object's own
keywords beyond its properties (a top-level anyOf, minProperties) and a raw string's `format`
cannot be said in this syntax: refused by name.
"""

from __future__ import annotations

import json
import re

from engine.api import GrammarError, json_lark
from colibri.serve.tools.base import BlockParser, ToolCall
from colibri.serve.tools.constrain import alternatives, block_grammar

KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$defs",
               "definitions", "$schema", "$id", "x-guidance"}
STRING_KEYS = {"type", "description", "title", "default", "examples", "enum", "const", "minLength", "maxLength",
               "pattern"}
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm4MoeParser(BlockParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        if not name or any(c.isspace() or c in "<>{}" for c in name):
            return None
        rest = "<arg_key>" + rest if rest else ""
        props = ((self.tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
        args = {}
        for key, value in PAIR.findall(rest):
            key = key.strip()
            args[key] = value if (props.get(key) or {}).get("type") == "string" else _loose(value)
        if PAIR.sub("", rest).strip():  # text between pairs that is not a pair: not this format
            return None
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _loose(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def grammar(marks, calls, *, forced: bool, parallel: bool, response_schema=None) -> str:
    """The calls as GLM's template writes them: `<tool_call>NAME\\n` then one key/value pair per
    argument, each on its own line, then `</tool_call>`; parallel calls on their own lines."""
    rules = []

    def body(call) -> str:
        return f"{json.dumps(call.name + chr(10))} {_pairs(marks, call, rules)}"

    item, call_rules = alternatives("glm_call", calls, body)
    opener, close = marks(Glm4MoeParser.OPEN), marks(Glm4MoeParser.CLOSE)
    section = f'{item} {close} ("\\n" {opener} {item} {close})*' if parallel else f"{item} {close}"
    return block_grammar(marks, Glm4MoeParser.OPEN, section, call_rules + "".join(rules), (Glm4MoeParser.OPEN,),
                         forced=forced, response_schema=response_schema)


def _pairs(marks, call, rules: list[str]) -> str:
    """The lark items of a call's key/value pairs; their rules go to `rules`."""
    schema, where = call.schema, f"function {call.name!r}"
    extra = sorted(set(schema) - OBJECT_KEYS)
    if extra or schema.get("type", "object") != "object":
        what = extra[0] if extra else f"type {schema.get('type')!r}"
        raise GrammarError(f"{where}: GLM's key/value call format cannot constrain the parameters' {what!r} "
                           "(only an object's properties)")
    props, required = schema.get("properties") or {}, set(schema.get("required") or [])
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    key_open, key_close, value_open = marks(KEY_OPEN), marks(KEY_CLOSE), marks(VALUE_OPEN)
    items = []
    for key, spec in props.items():
        rule = f"glm_{len(rules)}"
        value, value_rules = _value(marks, rule, spec, defs, f"{where}, parameter {key!r}")
        rules.append(f'{rule}: {key_open} {json.dumps(key)} {key_close} "\\n" {value_open} {value} "\\n"\n'
                     + value_rules)
        items.append(rule if key in required else f"{rule}?")
    if not props and schema.get("additionalProperties", True) is not False:  # any object: any pairs
        rule = f"glm_{len(rules)}"
        value, value_rules = marks.until(f"{rule}_v", "ANY", VALUE_CLOSE)
        rules.append(f'{rule}: {key_open} /[A-Za-z0-9_.-]+/ {key_close} "\\n" {value_open} {value} "\\n"\n'
                     + value_rules)
        items.append(f"{rule}*")
    return " ".join(items) if items else '""'


def _value(marks, rule: str, spec, defs: dict, where: str) -> tuple[str, str]:
    """(item, rules) of one value and its closing marker: a string parameter's raw text (how the
    template writes it and the parser reads it back), any other as JSON."""
    if not (isinstance(spec, dict) and spec.get("type") == "string"):
        return f"{json_lark({**defs, **spec} if isinstance(spec, dict) else spec)} {marks(VALUE_CLOSE)}", ""
    extra = sorted(set(spec) - STRING_KEYS)
    if extra:
        raise GrammarError(f"{where}: GLM writes a string argument as raw text, whose {extra[0]!r} "
                           "this server cannot constrain")
    terminal = rule.upper() + "_TEXT"
    if "const" in spec or "enum" in spec:
        options = [spec["const"]] if "const" in spec else spec["enum"]
        words = [json.dumps(o) for o in options if isinstance(o, str)]
        if not words:
            raise GrammarError(f"{where}: a string parameter with no string among its enum")
        definition = " | ".join(words)
    else:
        low, high = spec.get("minLength", 0), spec.get("maxLength")
        definition = "/(?s:.{%d,%s})/" % (low, "" if high is None else high)
        if spec.get("pattern") is not None:
            definition += " & " + _search(spec["pattern"])
    item, rules = marks.until(rule + "_v", terminal, VALUE_CLOSE)
    return item, f"{terminal}: {definition}\n" + rules


def _search(pattern: str) -> str:
    """A JSON Schema pattern (it matches anywhere in the string unless anchored) as a regex that
    matches the whole value."""
    if not isinstance(pattern, str):
        raise GrammarError("pattern must be a string")
    body = pattern[1:] if pattern.startswith("^") else "(?s:.*)" + pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    else:
        body += "(?s:.*)"
    return "/" + body.replace("/", "\\/") + "/"
