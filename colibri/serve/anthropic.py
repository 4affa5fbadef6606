"""POST /v1/messages: Anthropic's Messages API beside the OpenAI routes, as llama-server offers, so
tools that speak it (the `anthropic` client, Claude Code-style agents) can use a local model.

The request is translated into the chat request the OpenAI route serves (system, text,
tool_use/tool_result blocks → the chat template's messages; tools' input_schema → parameters;
tool_choice auto/any/tool/none → auto/required/named/none) and runs on the same worker and queue.
The answer comes back as Anthropic content blocks, whole or as Anthropic's server-sent events
(message_start, content_block_start/delta/stop, message_delta, message_stop). Errors are
Anthropic error objects ({"type": "error", "error": {"type", "message"}}), naming the field.

Refused by name: image/document/thinking blocks, server tools (web search, bash, ...), `top_k`,
extended `thinking`, and a final assistant message (prefill). Any model name is accepted (clients
send their own), and the answer names the model served.
"""

from __future__ import annotations

import hmac
import json
import uuid

from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.api import ColibriError
from colibri.serve.jobrun import SHUTDOWN, JobRun
from colibri.serve.protocol import MAX_MESSAGES, ApiError, ChatRequest, bad, parse_sampling
from colibri.serve.tools.base import ToolCall
from colibri.serve.tools.chat import tool_prompt
from colibri.serve.tools.output import ToolOutput, whole
from colibri.serve.tools.request import NAME, FieldError, ToolArguments, name_tool_results, parse_tool_fields

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "cancelled": "end_turn"}


def anthropic_error(exc: ApiError) -> JSONResponse:
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}},
                        status_code=exc.status, headers=exc.headers)


def check_key(request, api_key: str | None) -> None:
    """Anthropic clients send `x-api-key`; `Authorization: Bearer` is taken too."""
    if api_key is None:
        return
    given = request.headers.get("x-api-key")
    if given is None:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key (x-api-key: <key>)")


class PlainParser:
    """The answer as content, when no tools are in play."""

    def __init__(self, tools=None):
        pass

    def feed(self, text: str) -> list[tuple]:
        return [("content", text)]

    def finish(self) -> list[tuple]:
        return []


def _text(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise bad(f"{where}[{j}]", "only text blocks are supported here")
            parts.append(block["text"])
        return "".join(parts)
    raise bad(where, "must be a string or a list of text blocks")


def _message(m, i: int) -> list[dict]:
    """One Anthropic message → the chat messages it stands for (tool results become `tool` messages)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"messages[{i}].role", "must be 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content", "is required: a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"messages[{i}].content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad(f"{at}.name", "is required: a string")
            if not isinstance(args, dict):
                raise bad(f"{at}.input", "must be an object")
            ident = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{i}_{j}"
            calls.append({"id": ident, "type": "function", "function": {
                "name": name, "arguments": ToolArguments(args, json.dumps(args, ensure_ascii=False))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id", "is required: a string")
            body = block.get("content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": "" if body is None else _text(body, f"{at}.content")})
        else:
            raise bad(f"{at}.type", f"{kind!r} blocks are not supported in a {role} message (text, tool_use, "
                                    "tool_result are)")
    text = "".join(texts)
    if role == "assistant":
        out = {"role": role, "content": text if text or not calls else None}
        return [{**out, "tool_calls": calls} if calls else out]
    return results + ([{"role": role, "content": text}] if texts or not results else [])


def _tools(body: dict) -> dict:
    """Anthropic's tools and tool_choice in OpenAI's shape, checked under their Anthropic names."""
    tools, out = body.get("tools"), {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list of tools")
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad(f"tools[{i}].type", f"server tools ({kind!r}) are not supported; custom tools are")
            if not isinstance(t.get("name"), str) or not NAME.match(t["name"]):
                raise bad(f"tools[{i}].name", "must be 1 to 64 letters, digits, underscores or dashes")
            if not isinstance(t.get("input_schema"), dict):
                raise bad(f"tools[{i}].input_schema", "is required: a JSON Schema object")
            if t.get("description") is not None and not isinstance(t["description"], str):
                raise bad(f"tools[{i}].description", "must be a string")
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            if t.get("strict") is not None:  # Anthropic's strict tool use: the arguments follow the schema
                if not isinstance(t["strict"], bool):
                    raise bad(f"tools[{i}].strict", "must be true or false")
                fn["strict"] = t["strict"]
            converted.append({"type": "function", "function": fn})
        out["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise bad("tool_choice.type", "must be one of auto, any, tool, none")
        if kind == "tool" and not isinstance(choice.get("name"), str):
            raise bad("tool_choice.name", "is required for {type: tool}")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                              else {"any": "required"}.get(kind, kind))
        if choice.get("disable_parallel_tool_use") is not None:
            if not isinstance(choice["disable_parallel_tool_use"], bool):
                raise bad("tool_choice.disable_parallel_tool_use", "must be true or false")
            out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return out


# OpenAI sampling field → the Anthropic name a refusal must name.
RENAMED = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def parse_messages(body) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required")
    for key in ("top_k",):
        if body.get(key) is not None:
            raise bad(key, "is not supported by this server")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise bad("thinking", "extended thinking is not supported by this server")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "is required: a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages")
    chat = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        chat += _message(m, i)
    name_tool_results(chat)
    if messages[-1].get("role") == "assistant":
        raise bad(f"messages[{len(messages) - 1}].role", "a final assistant message (prefill) is not supported")
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad("stop_sequences", "must be a list of strings")
    fields = {"max_tokens": body["max_tokens"], "temperature": body.get("temperature"),
              "top_p": body.get("top_p"), "stop": stop or None, "stream": body.get("stream")}
    try:
        sampling = parse_sampling(fields, 0)
        if sampling.temperature > 1:  # Anthropic's range is [0, 1]
            raise bad("temperature", f"must be in [0.0, 1.0], got {sampling.temperature}")
        tools = parse_tool_fields(_tools(body))
    except ApiError as exc:
        raise _renamed(exc) from None
    except FieldError as exc:
        raise bad(exc.param.replace(".function", ""), exc.message) from None
    return ChatRequest(body.get("model") if isinstance(body.get("model"), str) else None, chat, sampling, tools)


def _renamed(exc: ApiError) -> ApiError:
    name = RENAMED.get(exc.param, exc.param)
    if name and name.startswith("tools["):  # the OpenAI shape's names of a converted tool field
        name = name.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    message = exc.message.replace(f"{exc.param}:", f"{name}:", 1) if exc.param else exc.message
    return ApiError(exc.status, message, param=name, code=exc.code)


def _prompt(state, req: ChatRequest):
    if req.tools.engaged:
        return tool_prompt(state, req)
    try:
        prompt = state.template.render(req.messages, add_generation_prompt=True)
    except ColibriError as exc:
        raise bad("messages", str(exc)) from None
    return state.tokenizer.encode(prompt, add_special_tokens=False).ids, ToolOutput(PlainParser(), req.tools)


def tool_input(call: ToolCall) -> dict | None:
    """A call's arguments as tool_use's `input`, or None when they are no JSON object (a call
    without a grammar, or cut by max_tokens): Anthropic's `input` is an object, so such a call is
    given back as its text."""
    try:
        value = call.input()
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": tool_input(call)}


def blocks(content: str | None, calls: list[ToolCall]) -> list[dict]:
    """A whole answer's content blocks: its text, then its calls (one that is no object, as text)."""
    out = [{"type": "text", "text": content}] if content else []
    for call in calls:
        if tool_input(call) is not None:
            out.append(tool_use(call))
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += call.raw
        else:
            out.append({"type": "text", "text": call.raw})
    return out


def stop_details(result, text: str, stops: list[str], decode) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a generation without calls. A stop sequence cut the text
    when the generation said "stop" without ending at end-of-sequence: which one is the earliest
    found in the decoded tail past the text."""
    reason = STOP_REASONS.get(result.finish_reason, "end_turn")
    gen = result.generation
    if result.finish_reason != "stop" or not stops or gen is None or len(gen.output_ids) > len(result.output_ids):
        return reason, None
    tail = decode(result.output_ids)[len(text):]
    found = sorted((at, s) for s in stops if (at := tail.find(s)) != -1)
    return "stop_sequence", (found[0][1] if found else stops[0])


class EventMaker:
    """Anthropic's stream events for one answer (pure: tested without a server)."""

    def __init__(self, ident: str, model: str, input_tokens: int):
        self.ident, self.model, self.input_tokens = ident, model, input_tokens
        self.index = 0
        self.text_open = False
        self.used = False  # a tool_use block was sent

    def start(self) -> list[tuple]:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.ident, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def _close_text(self) -> list[tuple]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def events(self, events: list[tuple]) -> list[tuple]:
        out = []
        for kind, value in events:
            if kind == "content":
                if not self.text_open:
                    self.text_open = True
                    out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": {"type": "text", "text": ""}}))
                out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": {"type": "text_delta", "text": value}}))
                continue
            if kind not in ("call", "call_end"):  # a call's pieces: it is sent whole once it ends
                continue
            if tool_input(value) is None:  # arguments that are no JSON object: the model's text
                out += self.events([("content", value.raw)])
                continue
            out += self._close_text()
            self.used = True
            block = {**tool_use(value), "input": {}}
            out += [("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": block}),
                    ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": value.arguments}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
            self.index += 1
        return out

    def end(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> list[tuple]:
        return self._close_text() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                  "stop_sequence": stop_sequence},
                               "usage": {"output_tokens": output_tokens}}),
            ("message_stop", {"type": "message_stop"})]


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def messages_endpoint(request, state, body) -> Response:
    try:
        req = parse_messages(body)
        try:
            ids, output = _prompt(state, req)
        except ApiError as exc:
            raise _renamed(exc) from None
        special = req.tools.engaged
        run = JobRun(state, ids, req.sampling, special_text=special)
    except ApiError as exc:
        return anthropic_error(exc)
    except ColibriError as exc:  # the input's fault by definition (a prompt the tokenizer refused)
        return anthropic_error(ApiError(400, str(exc)))
    decode = (lambda t: state.tokenizer.decode(t, skip_special_tokens=not special))
    ident = f"msg_{uuid.uuid4().hex[:24]}"
    headers = {"x-colibri-seed": str(req.sampling.seed)}  # Anthropic's body has no seed field: the header
    if req.sampling.stream:
        return StreamingResponse(_stream(run, output, req, ident, state.model_id, len(ids), decode),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    try:
        got = await run.collect(request)
    except ApiError as exc:  # the server is stopping
        return anthropic_error(exc)
    if got is None:
        return Response(status_code=499)
    text, result = got
    if result.finish_reason == "error":
        return anthropic_error(ApiError(500, f"generation failed: {result.error}", type="server_error"))
    content, calls = whole(output, text)
    answer = blocks(content, calls)
    if any(b["type"] == "tool_use" for b in answer) and output.finish_reason(result.finish_reason) == "tool_calls":
        reason, sequence = "tool_use", None
    else:
        reason, sequence = stop_details(result, text, req.sampling.stop, decode)
    return JSONResponse({"id": ident, "type": "message", "role": "assistant", "model": state.model_id,
                         "content": answer, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": {"input_tokens": len(ids), "output_tokens": len(result.output_ids)}},
                        headers=headers)


async def _stream(run: JobRun, output: ToolOutput, req: ChatRequest, ident: str, model: str, input_tokens: int,
                  decode):
    maker, text = EventMaker(ident, model, input_tokens), []
    try:
        for event in maker.start():
            yield _sse(*event)
        while True:
            kind, value = await run.next()
            if kind == "text":
                text.append(value)
                for event in maker.events(output.feed(value)):
                    yield _sse(*event)
                continue
            if kind == "shutdown":  # Anthropic's streams end with an error event, no [DONE]
                yield _sse("error", {"type": "error", "error": {"type": ERROR_TYPES[SHUTDOWN.status],
                                                               "message": SHUTDOWN.message}})
                return
            if value.finish_reason == "error":
                yield _sse("error", {"type": "error", "error": {"type": "api_error",
                                                               "message": f"generation failed: {value.error}"}})
                return
            events = maker.events(output.finish())
            if maker.used and output.finish_reason(value.finish_reason) == "tool_calls":
                reason, sequence = "tool_use", None
            else:
                reason, sequence = stop_details(value, "".join(text), req.sampling.stop, decode)
            for event in events + maker.end(reason, sequence, len(value.output_ids)):
                yield _sse(*event)
            return
    finally:
        run.cancel()  # the client left or the stream ended: the generation must not run on


async def count_tokens_endpoint(request, state, body) -> Response:
    """POST /v1/messages/count_tokens: the prompt's token count, as the model would see it."""
    try:
        req = parse_messages({**(body if isinstance(body, dict) else {}), "max_tokens": 1})
        ids, _ = _prompt(state, req)
    except ApiError as exc:
        return anthropic_error(_renamed(exc))
    return JSONResponse({"input_tokens": len(ids)})
