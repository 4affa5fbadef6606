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
        # what became of each call that began (streamed arguments): "call", "content" or "drop",
        # and the length of its head's text
        self.fate: dict[str, tuple[str, int]] = {}

    def feed(self, text: str) -> list[tuple]:
        return self._apply(self.parser.feed(text)) if text else []

    def finish(self) -> list[tuple]:
        out = self._apply(self.parser.finish())
        if self.pending and not self.calls:
            out.append(("content", self.pending))
        self.pending = ""
        return out

    def _rule(self, call: ToolCall) -> str:
        """A call's fate under tool_choice and parallel_tool_calls."""
        if self.request.named and call.name != self.request.choice:
            return "content"
        return "drop" if self.calls and not self.request.parallel else "call"

    def _apply(self, events: list[tuple]) -> list[tuple]:
        out: list[tuple] = []
        for kind, value in events:
            if kind in ("call", "call_begin"):
                fate = self._rule(value)
                if kind == "call_begin":
                    self.fate[value.id] = fate, len(value.raw)
                if fate == "drop":
                    continue
                if fate == "call":
                    self.calls.append(value)
                    self.pending = ""
                    out.append((kind, value))
                    continue
                kind, value = "content", value.raw
            elif kind in ("call_args", "call_end"):
                call = value[0] if kind == "call_args" else value
                fate, head = self.fate[call.id]
                if fate == "call":
                    out.append((kind, value))
                    continue
                if fate == "drop":
                    continue
                # a call given back as content: its text as it comes (the head went at call_begin)
                value = value[1] if kind == "call_args" else call.raw[head + len(call.arguments):]
                kind = "content"
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
