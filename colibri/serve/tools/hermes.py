"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2 Pro): one JSON object per call in XML-like tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

as Qwen3's chat template asks for ("For each function call, return a json object with function
name and arguments within <tool_call></tool_call> XML tags"); several blocks are parallel calls.
"""

from __future__ import annotations

import json

from colibri.serve.tools.base import BlockParser, Head, ToolCall, json_object
from colibri.serve.tools.constrain import alternatives, block_grammar

# A call's text up to its arguments, as the template renders it (and the grammar writes it).
HEAD = '{{"name": "{name}", "arguments": '


class HermesParser(BlockParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    # `{"name": "f", "arguments": ` (or "parameters"): the arguments stream from here
    HEADS = tuple(Head(" ", "{", " ", '"name"', " ", ":", " ", '"', "NAME", '"', " ", ",", " ", f'"{key}"', " ",
                       ":", " ") for key in ("arguments", "parameters"))

    def parse_block(self, body: str) -> list[ToolCall] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        # "parameters" is what some Hermes fine-tunes write; the template asks for "arguments".
        args = value.get("arguments", value.get("parameters", {}))
        text = json_object(args) if isinstance(args, str) else (json.dumps(args, ensure_ascii=False)
                                                                 if isinstance(args, dict) else None)
        return None if text is None else [ToolCall(value["name"], text)]


def grammar(marks, calls, *, forced: bool, parallel: bool, response_schema=None) -> str:
    """The calls as Qwen3's template writes them: `<tool_call>\\n{"name": "f", "arguments": {...}}
    \\n</tool_call>`, parallel calls on their own lines (colibri/serve/tools/constrain.py)."""
    opener, close = marks(HermesParser.OPEN), marks(HermesParser.CLOSE)
    item, rules = alternatives("hermes_call", calls, lambda c: f'{json.dumps(HEAD.format(name=c.name))} {c.args()} "}}"')
    rules += f'hermes_one: "\\n" {item} "\\n" {close}\n'
    section = f'hermes_one ("\\n" {opener} hermes_one)*' if parallel else "hermes_one"
    return block_grammar(marks, HermesParser.OPEN, section, rules, (HermesParser.OPEN,), forced=forced,
                         response_schema=response_schema)
