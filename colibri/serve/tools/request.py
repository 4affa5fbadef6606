"""The tool fields of a chat request, validated: `tools`, `tool_choice`, `parallel_tool_calls`, and
the assistant `tool_calls` / `tool` messages of the history.

Pure validation, no HTTP: a bad field raises FieldError(param, message), which the OpenAI routes
(colibri/serve/protocol.py) and the Anthropic route (colibri/serve/anthropic.py) turn into their own
400 error objects. This module imports nothing of the server, so protocol.py can import it.

Templates are given what transformers' apply_chat_template is given: `tools` as a list of
{"type": "function", "function": {...}} dicts, and each call's `arguments` as a dict (vLLM and
llama-server parse OpenAI's JSON-string arguments for the same reason: GLM iterates them with
`.items()`, gpt-oss and vLLM's DeepSeek template pipe them through `tojson`). DeepSeek's published
template concatenates them as a string instead, so the dict is a ToolArguments that also renders as
the JSON text the client sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

MAX_TOOLS = 128  # OpenAI's own limit on `tools`
MAX_CALLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
CHOICES = ("auto", "none", "required")


class FieldError(ValueError):
    """One refused field: `param` names it as the client wrote it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


class ToolArguments(dict):
    """A call's arguments: a dict for templates that iterate or `tojson` them, and the client's JSON
    text wherever a template prints or concatenates them (`'...' + arguments` would raise
    TypeError on a plain dict: DeepSeek-V3's published template does exactly that)."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other):
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self.text if isinstance(other, str) else NotImplemented


@dataclass
class ToolRequest:
    """What the client asked of tools. `choice` is "auto", "none", "required" or a function name
    (`named`); `tools` is None when none were sent."""

    tools: list[dict] | None = None
    choice: str = "none"
    named: bool = False
    parallel: bool = True
    by_name: dict[str, dict] = field(default_factory=dict)

    @property
    def engaged(self) -> bool:
        """Whether tools go into the prompt and calls are parsed out of the answer."""
        return bool(self.tools) and self.choice != "none"

    def offered(self) -> list[dict] | None:
        """The tools the template renders: with a named choice, that one alone (the grammar forces
        the call, and a model shown only the function it must call is not tempted by the others)."""
        if not self.engaged:
            return None
        return [self.by_name[self.choice]] if self.named else self.tools


def _tool(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise FieldError(where, "must be an object {type: function, function: {...}}")
    if value.get("type", "function") != "function":
        raise FieldError(f"{where}.type", f"only 'function' tools are supported, got {value.get('type')!r}")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise FieldError(f"{where}.function", "is required: an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise FieldError(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise FieldError(f"{where}.function.description", "must be a string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise FieldError(f"{where}.function.parameters", "must be a JSON Schema object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise FieldError(f"{where}.function.strict", "must be true or false")
    # The client's keys go to the template as given (a template may read any of them); only the
    # checked ones are relied on here.
    return {"type": "function", "function": dict(fn)}


def parse_tool_fields(body: dict, tools_key: str = "tools", choice_key: str = "tool_choice") -> ToolRequest:
    raw = body.get(tools_key)
    if raw is None or raw == []:
        tools = None
    elif not isinstance(raw, list):
        raise FieldError(tools_key, "must be a list of function tools")
    elif len(raw) > MAX_TOOLS:
        raise FieldError(tools_key, f"at most {MAX_TOOLS} tools, got {len(raw)}")
    else:
        tools = [_tool(t, f"{tools_key}[{i}]") for i, t in enumerate(raw)]
    by_name: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        name = t["function"]["name"]
        if name in by_name:
            raise FieldError(f"{tools_key}[{i}].function.name", f"{name!r} is defined twice")
        by_name[name] = t
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "must be true or false")
    choice, named = _choice(body.get(choice_key), choice_key, by_name, tools is not None)
    return ToolRequest(tools, choice, named, parallel, by_name)


def _choice(value, key: str, by_name: dict, have_tools: bool) -> tuple[str, bool]:
    if value is None:
        return ("auto" if have_tools else "none"), False
    if isinstance(value, str):
        if value not in CHOICES:
            raise FieldError(key, f"must be one of {', '.join(CHOICES)} or {{type: function, function: {{name}}}}")
        if value == "required" and not have_tools:
            raise FieldError(key, "'required' needs `tools`")
        return value, False
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise FieldError(key, "must be a string or {type: function, function: {name}}")
    if name not in by_name:
        raise FieldError(f"{key}.function.name", f"{name!r} is not one of the request's tools")
    return name, True


def arguments(value, where: str) -> ToolArguments:
    """OpenAI sends arguments as a JSON string; a dict is taken too (some clients send one)."""
    if isinstance(value, dict):
        return ToolArguments(value, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str):
        raise FieldError(where, "must be a JSON object in a string")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except ValueError:
        raise FieldError(where, "is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise FieldError(where, f"must be a JSON object, got {type(parsed).__name__}")
    return ToolArguments(parsed, value)


def parse_tool_calls(value, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, in the shape templates read."""
    if not isinstance(value, list) or not value:
        raise FieldError(where, "must be a non-empty list of calls")
    if len(value) > MAX_CALLS:
        raise FieldError(where, f"at most {MAX_CALLS} calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise FieldError(at, "must be an object {id, type: function, function: {name, arguments}}")
        if call.get("type", "function") != "function":
            raise FieldError(f"{at}.type", "must be 'function'")
        ident = call.get("id")
        if ident is not None and not isinstance(ident, str):
            raise FieldError(f"{at}.id", "must be a string")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{at}.function.name", "is required: a string")
        calls.append({"id": ident or f"call_{j}", "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments(fn.get("arguments", "{}"),
                                                                              f"{at}.function.arguments")}})
    return calls


def name_tool_results(messages: list[dict]) -> None:
    """Give each `tool` message without a `name` the name of the call it answers, found by
    tool_call_id: templates that label results by function (GLM, gpt-oss) then have it."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
