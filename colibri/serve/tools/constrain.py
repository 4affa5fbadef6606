"""Grammar-constrained tool calls: the llguidance grammar of the calls a request allows, in the
model's own call syntax, with each function's JSON schema for its arguments.

When a grammar applies (the token mask of engine/run/grammar.py, on the worker):
  - `tool_choice` "required" or a named function: the answer is calls only, from its first
    token, each to an offered function with arguments that validate against its schema;
  - "auto" with at least one `strict: true` function: free text, and once the text opens a call
    (the format's opening marker), the call is constrained as above: strict functions'
    arguments by their schema, the others' to any JSON object;
  - "auto" with `response_format`: the content is the response schema's JSON, or calls;
  - otherwise (auto, no strict function, no response_format) no grammar: the model's text as is.
`parallel_tool_calls` false allows one call. After the calls the grammar is complete and the
generation ends there (finish_reason "tool_calls"), as the family's model ends its turn.

A schema the grammar engine cannot compile is refused (FieldError naming the function's
`parameters`, with the engine's words, which name the construct) before the request is queued.

Markers: a marker that is an added token of the model's vocabulary (DeepSeek's, gpt-oss's, Qwen's
`<tool_call>`) is named by its id, the one token the model was trained to write; in llguidance
no text regex ever matches an added token, so free text cannot write a marker either except
where the grammar puts it. A marker that is plain text in the vocabulary (the tests' tiny models)
is a string literal, and free text that a marker ends is a lazy lexeme (llguidance's lexer does
not split a greedy lexeme to let a following literal start inside it).
"""

from __future__ import annotations

import json

from engine.api import GrammarError, json_grammar, json_lark, lark_grammar
from colibri.serve.tools.request import FieldError, ToolRequest

ANY_OBJECT = {"type": "object"}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


class Marks:
    """How a grammar names markers in one tokenizer, and the free text between them."""

    def __init__(self, added: dict[str, int], eos_ids: set[int]):
        self.added, self.eos = added, set(eos_ids)

    @classmethod
    def of(cls, tokenizer, eos_ids: set[int]) -> Marks:
        # llguidance treats every added token as special (special flag or not): the same set here.
        decoder = tokenizer.get_added_tokens_decoder()
        return cls({tok.content: i for i, tok in decoder.items()}, eos_ids)

    def is_token(self, marker: str) -> bool:
        return marker in self.added

    def __call__(self, marker: str) -> str:
        """The lark item of a marker: its token, or its text."""
        return f"<[{self.added[marker]}]>" if self.is_token(marker) else json.dumps(marker)

    def specials(self, excluded: tuple[str, ...]) -> str | None:
        """The lark item of any added token free text may hold (a reasoning tag, a channel marker),
        but not end-of-sequence (the grammar's end) nor the `excluded` markers; None when none."""
        skip = self.eos | {self.added[m] for m in excluded if m in self.added}
        ids = sorted(i for i in self.added.values() if i not in skip)
        if not ids:
            return None
        ranges, start = [], ids[0]
        for a, b in zip(ids, ids[1:] + [None]):
            if b != a + 1:
                ranges.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        return "<[" + ",".join(ranges) + "]>"

    def text_terminal(self, excluded: tuple[str, ...]) -> str:
        """A terminal's definition: any text that holds none of the text `excluded` markers."""
        texts = [m for m in excluded if not self.is_token(m)]
        if not texts:
            return "ANY"
        return "ANY & ~(ANY (" + " | ".join(json.dumps(t) for t in texts) + ") ANY)"

    def until(self, name: str, terminal: str, marker: str) -> tuple[str, str]:
        """(item, rules): text of `terminal` then `marker`. A text marker makes it one lazy lexeme
        (it ends at the marker's first occurrence)."""
        if self.is_token(marker):
            return f"{terminal} {self(marker)}", ""
        return name, f"{name}[lazy]: {terminal} {json.dumps(marker)}\n"


class Call:
    """One function a grammar allows a call to: its name and its arguments' schema."""

    def __init__(self, name: str, schema: dict):
        self.name, self.schema = name, schema

    def args(self) -> str:
        return json_lark(self.schema)


def planned_calls(request: ToolRequest, response_schema: dict | None) -> list[Call] | None:
    """The calls a request's grammar allows, or None when it needs no grammar. Each constrained
    schema is compiled on its own first, so a refusal names the function's parameters."""
    forced = request.choice == "required" or request.named
    offered = request.offered() or []
    if not (forced or response_schema is not None or any(t["function"].get("strict") for t in offered)):
        return None
    index = {t["function"]["name"]: i for i, t in enumerate(request.tools or [])}
    calls = []
    for tool in offered:
        fn = tool["function"]
        if forced or fn.get("strict"):
            schema = fn.get("parameters") if fn.get("parameters") is not None else NO_PARAMETERS
            try:
                json_grammar(schema)
            except GrammarError as exc:
                raise FieldError(f"tools[{index[fn['name']]}].function.parameters", str(exc)) from None
        else:
            schema = ANY_OBJECT
        calls.append(Call(fn["name"], schema))
    return calls


def tool_grammar(fmt, request: ToolRequest, marks: Marks, response_schema: dict | None = None) -> str | None:
    """The compiled grammar of a request's calls in `fmt`'s syntax, or None (no constraint)."""
    calls = planned_calls(request, response_schema)
    if calls is None:
        return None
    forced = request.choice == "required" or request.named
    try:  # a syntax that cannot say a schema's construct refuses it (GLM's key/value pairs)
        return lark_grammar(fmt.grammar(marks, calls, forced=forced, parallel=request.parallel,
                                        response_schema=response_schema))
    except GrammarError as exc:
        raise FieldError("tools", str(exc)) from None


def block_grammar(marks: Marks, opener: str, section: str, rules: str, excluded: tuple[str, ...], *,
                  forced: bool, response_schema: dict | None) -> str:
    """The grammar of a format whose calls follow an opening marker (Hermes, DeepSeek, GLM):
    `section` is the rule of what follows `opener` (the calls and their closing markers);
    `excluded` the markers free text may not hold (those that open calls)."""
    lark = "%llguidance {}\n"
    if forced:
        lark += f"start: {marks(opener)} {section}\n"
    elif response_schema is not None:
        # content is the response schema's JSON, or the answer is calls
        lark += f"start: {json_lark(response_schema)} | {marks(opener)} {section}\n"
    else:
        head, head_rules = marks.until("call_head", "TEXT", opener)
        specials = marks.specials(excluded)
        pre = f"(TEXT {specials})* " if specials else ""
        lark += f"start: {pre}(TEXT | {head} {section})\n" + head_rules
        lark += f"TEXT: {marks.text_terminal(excluded)}\n"
    return lark + rules + "ANY: /(?s:.*)/\n"


def alternatives(prefix: str, calls: list[Call], body) -> tuple[str, str]:
    """(item, rules): one rule per function, `body(call)` its lark expansion."""
    names = [f"{prefix}_{i}" for i in range(len(calls))]
    rules = "".join(f"{n}: {body(c)}\n" for n, c in zip(names, calls))
    return "(" + " | ".join(names) + ")", rules
