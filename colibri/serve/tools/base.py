"""What every tool-call format shares: the parsed call, and a streaming splitter of the model's text
into content and call blocks delimited by markers.

A parser is fed the answer's text in the pieces the worker emits and returns events as soon as
they are final: ("content", text) for text the user sees, ("call", ToolCall) for a whole call. Text
that may be the start of a marker is held back until the next piece decides. A block whose body
does not parse is given back as content, markers included, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`
    raw: str = ""   # the model's text for this call: given back as content when the call is refused
    id: str = field(default_factory=call_id)

    def input(self) -> dict:
        """The arguments as an object (Anthropic's tool_use `input`)."""
        return json.loads(self.arguments)


def json_object(text: str) -> str | None:
    """`text` re-serialised if it is one JSON object, else None (a call whose arguments are not an
    object is not a call)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class BlockParser:
    """Content, then calls between `OPEN` and `CLOSE`; `DROP` markers (a list's outer brackets,
    DeepSeek's `<｜tool▁calls▁begin｜>`) vanish. Subclasses parse one block's body."""

    OPEN = ""
    CLOSE = ""
    DROP: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.buf = ""
        self.inside = False

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if self.inside:
                at = self.buf.find(self.CLOSE)
                if at == -1:
                    return out
                body, self.buf = self.buf[:at], self.buf[at + len(self.CLOSE):]
                self.inside = False
                out += self._block(body, closed=True)
                continue
            markers = (self.OPEN, *self.DROP)
            found = [(at, m) for m in markers if (at := self.buf.find(m)) != -1]
            if not found:
                keep = held_prefix(self.buf, markers)
                cut = len(self.buf) - keep
                if cut:
                    out.append(("content", self.buf[:cut]))
                self.buf = self.buf[cut:]
                return out
            at, marker = min(found)
            if at:
                out.append(("content", self.buf[:at]))
            self.buf = self.buf[at + len(marker):]
            self.inside = marker == self.OPEN

    def finish(self) -> list[tuple]:
        """The end of the answer: an unclosed block still counts when its body parses (a model may
        stop at end-of-sequence where the closing marker would be)."""
        rest, self.buf = self.buf, ""
        if self.inside:
            self.inside = False
            return self._block(rest, closed=False)
        return [("content", rest)] if rest else []

    def _block(self, body: str, closed: bool) -> list[tuple]:
        raw = self.OPEN + body + (self.CLOSE if closed else "")
        calls = self.parse_block(body)
        if not calls:
            return [("content", raw)]
        for c in calls:
            c.raw = raw
        return [("call", c) for c in calls]
