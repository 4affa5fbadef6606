"""DeepSeek-V3's calls, between its own marker tokens (V3 / R1 / V3-0324):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and V3.1's shorter body, `get_weather<｜tool▁sep｜>{"city": "Paris"}`. One block per call; the
list's outer markers are dropped.
"""

from __future__ import annotations

import json

from colibri.serve.tools.base import BlockParser, Head, ToolCall, json_object
from colibri.serve.tools.constrain import alternatives, block_grammar

SEP = "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(BlockParser):
    OPEN = "<｜tool▁call▁begin｜>"
    CLOSE = "<｜tool▁call▁end｜>"
    DROP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    # V3's `function<sep>NAME\n```json\n` and V3.1's `NAME<sep>`: the arguments stream from here
    HEADS = (Head(" ", "function", " ", SEP, " ", "NAME", " ", FENCE, " "), Head(" ", "NAME", " ", SEP, " "))

    def parse_block(self, body: str) -> list[ToolCall] | None:
        head, sep, rest = body.partition(SEP)
        if not sep:
            return None
        if FENCE in rest:  # V3: type<sep>name\n```json\n{...}\n```
            name, _, fenced = rest.partition(FENCE)
            args = fenced.strip()
            if args.endswith("```"):
                args = args[:-3]
        else:              # V3.1: name<sep>{...}
            name, args = head, rest
        name = name.strip()
        text = json_object(args.strip())
        return [ToolCall(name, text)] if name and text is not None else None


def grammar(marks, calls, *, forced: bool, parallel: bool, response_schema=None) -> str:
    """The calls as V3's template writes them: the list's opening marker, then per call
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, then
    the list's closing marker (colibri/serve/tools/constrain.py)."""
    begin, end = DeepSeekV3Parser.DROP

    def body(call) -> str:
        return " ".join((json.dumps(call.name + "\n" + FENCE + "\n"), call.args(), json.dumps("\n```")))

    item, rules = alternatives("ds_call", calls, body)
    rules += (f'ds_one: {marks(DeepSeekV3Parser.OPEN)} "function" {marks(SEP)} {item} '
              f'{marks(DeepSeekV3Parser.CLOSE)}\n')
    section = f"ds_one{'+' if parallel else ''} {marks(end)}"
    return block_grammar(marks, begin, section, rules, (begin, DeepSeekV3Parser.OPEN), forced=forced,
                         response_schema=response_schema)
