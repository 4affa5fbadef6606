"""DeepSeek-V3's calls, between its own marker tokens (V3 / R1 / V3-0324):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and V3.1's shorter body, `get_weather<｜tool▁sep｜>{"city": "Paris"}`. One block per call; the
list's outer markers are dropped.
"""

from __future__ import annotations

from colibri.serve.tools.base import BlockParser, ToolCall, json_object

SEP = "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(BlockParser):
    OPEN = "<｜tool▁call▁begin｜>"
    CLOSE = "<｜tool▁call▁end｜>"
    DROP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

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
