"""`response_format`: the OpenAI request field for structured output, parsed into a grammar.

    {"type": "text"}                                            no constraint (as if absent)
    {"type": "json_object"}                                     any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}

The schema is compiled here, while the request is parsed, so a schema the grammar engine cannot
compile is a 400 naming the construct (engine/run/grammar.py words it) before the request waits
in the queue. Both `strict` values are honoured the same way, strictly: the mask is always applied.
With tools, the schema goes into the calls' grammar instead (colibri/serve/tools/constrain.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import GrammarError, json_grammar
from colibri.serve.protocol import bad

TYPES = ("text", "json_object", "json_schema")
MAX_NAME = 64
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ResponseFormat:
    schema: dict   # the content's JSON schema (json_object: any object)
    grammar: str   # the schema compiled, for an answer without tools


def parse_response_format(body: dict) -> ResponseFormat | None:
    """What a request's response_format asks for, or None for free text."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("response_format", "must be an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind not in TYPES:
        raise bad("response_format.type", f"must be one of {', '.join(TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(ANY_OBJECT, json_grammar(None))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "is required with type json_schema: {name, schema, strict}")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME):
        raise bad("response_format.json_schema.name", f"must be a string of 1 to {MAX_NAME} characters")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "is required: a JSON Schema object")
    try:
        return ResponseFormat(schema, json_grammar(schema))
    except GrammarError as exc:
        raise bad("response_format.json_schema.schema", str(exc)) from None
