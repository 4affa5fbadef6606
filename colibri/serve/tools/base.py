"""What every tool-call format shares: the parsed call, and a streaming splitter of the model's text
into content and call blocks delimited by markers.

A parser is fed the answer's text in the pieces the worker emits and returns events as soon as
they are final: ("content", text) for text the user sees, ("call", ToolCall) for a whole call. Text
that may be the start of a marker is held back until the next piece decides. A block whose body
does not parse is given back as content, markers included, so nothing the model wrote is lost.

Arguments as they are generated: in the formats whose call names its function before a JSON
object of arguments (Hermes, DeepSeek-V3, harmony), a call begins once its head is read and its
arguments' object has opened: ("call_begin", ToolCall) with arguments "", then ("call_args",
(call, piece)) for each piece of the object's text as the model writes it, then ("call_end", call),
with `arguments` the whole text. From its head on it is a call whatever follows, as OpenAI's own
calls are: its arguments are the model's text, which only a grammar (tool_choice required or
named, strict functions: colibri/serve/tools/constrain.py) guarantees to be valid JSON, and which a
length cut leaves unfinished. A block whose head does not read so is parsed whole at its end.
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


class ArgsStream:
    """A call's arguments object as it is written: pieces of text passed on up to the object's end
    (braces counted outside strings, escapes skipped), the text after it kept apart."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False
        self.text = ""  # the object's text so far

    def feed(self, text: str) -> tuple[str, str]:
        """(the piece of the object in `text`, the rest of `text` past the object's end)."""
        if self.done:
            return "", text
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    self.text += text[:i + 1]
                    return text[:i + 1], text[i + 1:]
        self.text += text
        return text, ""


class Head:
    """A call's head read against a pattern of steps: literal text, optional whitespace (" "), or
    a function name ("NAME"). `read` says "yes" (with the name and the head's length), "maybe"
    (the text so far is a prefix of a head) or "no"."""

    NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")

    def __init__(self, *steps: str):
        self.steps = steps

    def read(self, text: str) -> tuple[str, str, int]:
        i, name = 0, ""
        for step in self.steps:
            if step == " ":
                while i < len(text) and text[i].isspace():
                    i += 1
            elif step == "NAME":
                j = i
                while j < len(text) and text[j] in self.NAME_CHARS:
                    j += 1
                if j == len(text):
                    return "maybe", "", 0
                if j == i:
                    return "no", "", 0
                name, i = text[i:j], j
            else:
                part = text[i:i + len(step)]
                if part != step[:len(part)]:
                    return "no", "", 0
                if len(part) < len(step):
                    return "maybe", "", 0
                i += len(step)
            if i == len(text):
                return "maybe", "", 0
        return "yes", name, i


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
    DeepSeek's `<｜tool▁calls▁begin｜>`) vanish. Subclasses parse one block's body, and name the
    HEADS that let a call begin before its block ends (each ends where the arguments' `{` is)."""

    OPEN = ""
    CLOSE = ""
    DROP: tuple[str, ...] = ()
    HEADS: tuple[Head, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.buf = ""
        self.inside = False
        self.whole = False                  # this block is parsed at its end (no head read)
        self.call: ToolCall | None = None   # the call this block began
        self.args: ArgsStream | None = None
        self.tail = ""                      # the block's text past the arguments

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if self.inside:
                if not self.whole and self.call is None:
                    out += self._head()
                if self.call is not None:
                    out += self._arguments()
                    if self.inside:
                        return out
                    continue
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
            self.whole, self.call, self.args, self.tail = False, None, None, ""

    def finish(self) -> list[tuple]:
        """The end of the answer: an unclosed block still counts when its body parses (a model may
        stop at end-of-sequence where the closing marker would be); a call that began ends."""
        rest, self.buf = self.buf, ""
        if self.inside and self.call is not None:
            self.inside = False
            return self._args_piece(rest) + self._end(closed=False)
        if self.inside:
            self.inside = False
            return self._block(rest, closed=False)
        return [("content", rest)] if rest else []

    def _head(self) -> list[tuple]:
        """A call begins once a head reads and its arguments' object opens; a body no head can
        read, or a block that closes first, is parsed whole."""
        cut = self.buf.find(self.CLOSE)
        body = self.buf if cut == -1 else self.buf[:cut]
        verdicts = [(h.read(body), h) for h in self.HEADS]
        for (verdict, name, end), _ in verdicts:
            if verdict == "yes" and body[end:end + 1] == "{":
                self.call = ToolCall(name, "", raw=self.OPEN + body[:end])
                self.args = ArgsStream()
                self.buf = self.buf[end:]
                return [("call_begin", self.call)]
        if cut != -1 or all(v[0] == "no" or (v[0] == "yes" and body[v[2]:]) for v, _ in verdicts):
            self.whole = True
        return []

    def _arguments(self) -> list[tuple]:
        at = self.buf.find(self.CLOSE)
        if at == -1:  # all but what may be the start of the closing marker
            cut = len(self.buf) - held_prefix(self.buf, (self.CLOSE,))
            piece, self.buf = self.buf[:cut], self.buf[cut:]
            return self._args_piece(piece)
        piece, self.buf = self.buf[:at], self.buf[at + len(self.CLOSE):]
        self.inside = False
        return self._args_piece(piece) + self._end(closed=True)

    def _args_piece(self, text: str) -> list[tuple]:
        piece, rest = self.args.feed(text)
        self.tail += rest
        return [("call_args", (self.call, piece))] if piece else []

    def _end(self, closed: bool) -> list[tuple]:
        call = self.call
        call.arguments = self.args.text
        call.raw += self.args.text + self.tail + (self.CLOSE if closed else "")
        self.call = self.args = None
        return [("call_end", call)]

    def _block(self, body: str, closed: bool) -> list[tuple]:
        raw = self.OPEN + body + (self.CLOSE if closed else "")
        calls = self.parse_block(body)
        if not calls:
            return [("content", raw)]
        for c in calls:
            c.raw = raw
        return [("call", c) for c in calls]
