"""gpt-oss's harmony format: the answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with `<|start|>assistant`, so the first header starts at `<|channel|>`; the
recipient may also stand before the channel, `<|start|>assistant to=functions.x<|channel|>...`).
A message addressed `to=functions.NAME` is a call; the `final` channel, and `commentary` with no
recipient (a preamble the user may see), are content; `analysis` is the model's reasoning, not
shown. `<|call|>` and `<|return|>` are end-of-sequence tokens, so the worker usually stops
before them: the answer's end closes the last message. A call's body is its arguments' JSON
object, passed on as it is written once it opens (call_begin / call_args / call_end, as in
colibri/serve/tools/base.py).

These markers are special tokens of gpt-oss's vocabulary; the worker keeps them in the text when
tools are in play (worker.py, Job.special_text), or there would be nothing to parse.
"""

from __future__ import annotations

import json
import re

from colibri.serve.tools.base import ArgsStream, ToolCall, held_prefix, json_object
from colibri.serve.tools.constrain import alternatives
from colibri.serve.tools.request import FieldError

MESSAGE = "<|message|>"
CHANNEL_MARK, CONSTRAIN, START, END = "<|channel|>", "<|constrain|>", "<|start|>", "<|end|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    def __init__(self, tools: list[dict] | None = None):
        self.buf = ""
        self.header: str | None = ""  # the header being read; None while in a body
        self.kind = ""                 # the body's: "content", "hidden" or "call"
        self.name = ""
        self.raw = ""                  # the open message's header, given back if its call fails
        self.call: ToolCall | None = None  # the call whose arguments are being passed on
        self.args: ArgsStream | None = None
        self.whole = False             # a call body that does not open an object: read at its end
        self.tail = ""                 # a call body's text past its arguments

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while True:
            if self.header is not None:
                at = self.buf.find(MESSAGE)
                if at == -1:
                    return out
                self._open(self.buf[:at])
                self.buf = self.buf[at + len(MESSAGE):]
                continue
            found = [at for m in ENDS if (at := self.buf.find(m)) != -1]
            if not found:
                cut = len(self.buf) - held_prefix(self.buf, ENDS)
                if self.kind == "content":
                    if cut:
                        out.append(("content", self.buf[:cut]))
                    self.buf = self.buf[cut:]
                elif self.kind == "call":
                    out += self._arguments(cut)
                return out
            if self.kind == "call":  # the body up to the end marker, passed on if it began
                out += self._arguments(min(found))
                found = [at for m in ENDS if (at := self.buf.find(m)) != -1]
            at = min(found)
            out += self._close(self.buf[:at])
            rest = self.buf[at:]
            # The end marker is dropped; `<|start|>` begins the next header, which ignores it.
            self.buf = rest[len(next(m for m in ENDS if rest.startswith(m))):]
            self.header = ""

    def finish(self) -> list[tuple]:
        out = self._arguments(len(self.buf)) if self.header is None and self.kind == "call" else []
        rest, self.buf = self.buf, ""
        if self.header is not None:
            # No `<|message|>` came: a model that wrote plain text, not harmony, wrote content.
            return [("content", rest)] if rest and "<|channel|>" not in rest else []
        return out + self._close(rest)

    def _arguments(self, cut: int) -> list[tuple]:
        """Pass on a call body's `buf[:cut]` once its object has opened (consumed then)."""
        if self.call is None:
            body = self.buf[:cut]
            start = len(body) - len(body.lstrip())
            if self.whole or start == len(body):
                return []
            if body[start] != "{":
                self.whole = True
                return []
            self.call, self.args = ToolCall(self.name, "", raw=self.raw + body[:start]), ArgsStream()
            self.buf = self.buf[start:]
            cut -= start
            out = [("call_begin", self.call)]
        else:
            out = []
        piece, rest = self.args.feed(self.buf[:cut])
        self.tail += rest
        self.buf = self.buf[cut:]
        return out + ([("call_args", (self.call, piece))] if piece else [])

    def _open(self, header: str) -> None:
        self.header = None
        channel = CHANNEL.search(header)
        recipient = RECIPIENT.search(header)
        self.raw = header + MESSAGE
        if recipient and recipient.group(1).startswith("functions."):
            self.kind, self.name = "call", recipient.group(1)[len("functions."):]
        elif recipient:  # a built-in tool (browser, python) this server does not run: shown as text
            self.kind = "raw"
        elif channel and channel.group(1) == "analysis":
            self.kind = "hidden"
        else:
            self.kind = "content"

    def _close(self, body: str) -> list[tuple]:
        if self.call is not None:  # its arguments were passed on: the call ends
            call, self.call = self.call, None
            call.arguments = self.args.text
            call.raw += self.args.text + self.tail + body
            self.args, self.tail, self.whole = None, "", False
            return [("call_end", call)]
        self.whole = False
        if self.kind == "content":
            return [("content", body)] if body else []
        if self.kind == "call":
            args = json_object(body.strip() or "{}")
            if self.name and args is not None:
                return [("call", ToolCall(self.name, args, raw=self.raw + body))]
            return [("content", self.raw + body)]
        if self.kind == "raw":
            return [("content", self.raw + body)]
        return []


def grammar(marks, calls, *, forced: bool, parallel: bool, response_schema=None) -> str:
    """Harmony's calls (colibri/serve/tools/constrain.py). The prompt ends with `<|start|>assistant`,
    so the answer starts at a header. Forced, it is one call in the model card's form:
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (no reasoning message
    first: an analysis has no bound). Auto, any messages without a recipient (reasoning, preamble,
    final answer), and once a header says `to=functions.`, the call. `<|call|>` ends a turn, so a
    turn holds one call whatever `parallel_tool_calls` says."""
    if response_schema is not None:
        raise FieldError("response_format", "with tools is not supported for gpt-oss's harmony format "
                                            "(its content is a message in a channel, not the answer's text)")
    m = marks
    channel, constrain, message = m(CHANNEL_MARK), m(CONSTRAIN), m(MESSAGE)
    if forced:
        item, rules = alternatives("harmony_fn", calls,
                                   lambda c: f"{json.dumps(c.name)} \" \" {constrain} \"json\" {message} {c.args()}")
        return f'%llguidance {{}}\nstart: {channel} "commentary to=functions." {item}\n' + rules
    item, rules = alternatives("harmony_fn", calls, lambda c: f"{json.dumps(c.name)} harmony_post {message} {c.args()}")
    body_end, body_rules = m.until("harmony_body", "BODY", END)
    to, to_rules = m.until("harmony_to", "RECIPIENT_TEXT", "to=functions.")
    return ("%llguidance {}\n"
            f"start: (harmony_header {message} {body_end} {m(START)} \"assistant\")* (harmony_call | harmony_last)\n"
            f"harmony_last: harmony_header {message} BODY\n"
            f"harmony_call: (HEADER_TEXT? ({channel} | {constrain}))* {to} {item}\n"
            f"harmony_header: (HEADER_TEXT | {channel} | {constrain})*\n"
            # after the name, the header's forms: ` <|constrain|>json` (the model card's),
            # `<|channel|>commentary json` (the template's), with `<|constrain|>`, or nothing
            f"harmony_post: (\" \" {constrain} \"json\" | {channel} \"commentary\" "
            f"(\" json\" | \" \" {constrain} \"json\")?)?\n"
            + to_rules + rules + body_rules
            # a header's words (channel names, `json`); no `=`, so no recipient but a function
            + "HEADER_TEXT: /[A-Za-z0-9_ .]+/\n"
            + "RECIPIENT_TEXT: /[A-Za-z0-9_ .]*/\n"
            + f"BODY: {m.text_terminal(ENDS)}\n"
            + "ANY: /(?s:.*)/\n")
