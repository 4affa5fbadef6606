"""GLM-4.5 / GLM-4.6 / GLM-4.7 / GLM-5 calls: the function name, then each argument as a key/value
pair of tags (GLM-4.5 puts newlines between them, GLM-4.7 and 5 do not):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The template writes a string value as is and anything else as JSON (`v | tojson if v is not
string else v`), so a value is read back by the parameter's schema: a string parameter keeps the
raw text, any other is JSON when it parses (`42` is a number, `[1]` a list), text otherwise.
"""

from __future__ import annotations

import json
import re

from colibri.serve.tools.base import BlockParser, ToolCall

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
