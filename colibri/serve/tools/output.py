"""A request's answer as events after the request's tool rules: the format parser's events, with
`tool_choice` and `parallel_tool_calls` applied, and whitespace between content and calls held so
that the streamed and the whole answer say the same thing.

Rules (with tool_choice required or named, or strict functions, the grammar of
colibri/serve/tools/constrain.py already keeps the answer inside them; these hold for the rest):
  - a named `tool_choice`: a call to any other function is given back as content;
  - `parallel_tool_calls` false: calls after the first are dropped;
  - whitespace that only separates content from a call ("Let me check.\\n\\n<tool_call>") is dropped;
  - `required` or named with no parsable call: the text is the content, finish_reason "stop".
"""

from __future__ import annotations

from colibri.serve.tools.base import ToolCall
from colibri.serve.tools.request import ToolRequest


class ToolOutput:
    def __init__(self, parser, request: ToolRequest):
        self.parser, self.request = parser, request
        self.calls: list[ToolCall] = []
        self.pending = ""  # trailing whitespace of the content so far

    def feed(self, text: str) -> list[tuple]:
        return self._apply(self.parser.feed(text)) if text else []

    def finish(self) -> list[tuple]:
        out = self._apply(self.parser.finish())
        if self.pending and not self.calls:
            out.append(("content", self.pending))
        self.pending = ""
        return out

    def _apply(self, events: list[tuple]) -> list[tuple]:
        out: list[tuple] = []
        for kind, value in events:
            if kind == "call":
                if self.request.named and value.name != self.request.choice:
                    kind, value = "content", value.raw
                elif self.calls and not self.request.parallel:
                    continue
                else:
                    self.calls.append(value)
                    self.pending = ""
                    out.append(("call", value))
                    continue
            text = self.pending + value
            body = text.rstrip()
            self.pending = text[len(body):]
            if body:
                out.append(("content", body))
        return out

    def finish_reason(self, generation_reason: str) -> str:
        return "tool_calls" if self.calls and generation_reason == "stop" else generation_reason


def whole(output: ToolOutput, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content None when the answer is calls alone."""
    events = output.feed(text) + output.finish()
    content = "".join(v for k, v in events if k == "content")
    return (content or None) if output.calls else content, output.calls
