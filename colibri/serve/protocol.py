"""The OpenAI request fields `colibri serve` accepts, validated, and the error objects it answers with.

Clients send more fields than any one server honours, so unknown fields are ignored (as OpenAI's
own API and llama-server do); a known field with a wrong type or an out-of-range value is a 400
with an OpenAI-style error object naming the field. Fields we cannot honour (echo, best_of, suffix,
the deprecated functions / function_call, and tools on /v1/completions) are refused by name rather
than silently dropped; `n` choices run as n
sequences of the batch (colibri/serve/worker.py), at most the server's max_batch. Chat's
tool fields are read by colibri/serve/tools/request.py. Sampling fields and their ranges: README's
serve section (the ranges are OpenAI's where OpenAI documents the field).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

from colibri.serve.tools.request import FieldError, ToolRequest, name_tool_results, parse_tool_calls, parse_tool_fields

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_MAX = 2 ** 63 - 1
TOP_LOGPROBS_MAX = 20       # chat's top_logprobs, as OpenAI documents it
COMPLETION_LOGPROBS_MAX = 5  # the completions API's logprobs, as OpenAI documents it
PENALTY_MAX = 2.0            # presence / frequency: [-2, 2]
BIAS_MAX = 100.0             # logit_bias values: [-100, 100]
REPETITION_MAX = 10.0        # repetition_penalty (llama-server's and vLLM's name): (0, 10]
N_MAX = 128                  # choices per request (OpenAI's limit); the server's max_batch bounds it first


class ApiError(Exception):
    """One refused request: the HTTP status and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass
class Sampling:
    max_tokens: int | None  # None: the room the prompt leaves in the context (set once it is tokenized)
    temperature: float
    top_p: float
    seed: int  # a request without one gets a fresh one (reported back, so it can be replayed)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none reported; k: each token's log-prob and its k best alternatives
    grammar: str | None = None  # response_format's, compiled (colibri/serve/structured.py)
    n: int = 1  # choices: n sequences of one prompt, choice i sampled with seed + i


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    sampling: Sampling


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    sampling: Sampling
    tools: ToolRequest = field(default_factory=ToolRequest)
    response_schema: dict | None = None  # response_format's (colibri/serve/structured.py), for the calls' grammar


def _int(body: dict, key: str, default, lo: int, hi: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise bad(key, f"must be in [{lo}, {hi}], got {value}")
    return value


def _float(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        raise bad(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return value


def _bool(body: dict, key: str, default: bool, where: str = "") -> bool:
    """where: the path of the object `body` is inside the request ("stream_options."), for the error's name."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(where + key, f"must be true or false, got {type(value).__name__}")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "must be a string or a list of strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise bad("stop", f"at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in items):
        raise bad("stop", f"each sequence must have 1 to {MAX_STOP_CHARS} characters")
    return items


def _refuse_unsupported(body: dict) -> None:
    # functions / function_call: OpenAI's deprecated tool fields (`tools`, `tool_choice` replace them)
    for key, harmless in (("echo", (None, False)), ("best_of", (None, 1)), ("suffix", (None, "")),
                          ("tools", (None, [])), ("functions", (None, [])), ("function_call", (None, "none", "auto"))):
        if body.get(key, None) not in harmless:
            raise bad(key, "is not supported by this server")


def _logit_bias(body: dict) -> dict[int, float]:
    """{"token id": bias}: ids as decimal strings (JSON keys), biases in [-100, 100]. Whether an
    id is in the vocabulary is checked with the prompt (GenerationWorker.check_fits)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("logit_bias", "must be an object mapping token ids to biases")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad("logit_bias", f"keys must be token ids (decimal integers), got {key[:40]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -BIAS_MAX <= bias <= BIAS_MAX:
            raise bad("logit_bias", f"the bias of token {key} must be a number in [-{BIAS_MAX:g}, {BIAS_MAX:g}]")
        out[int(key)] = float(bias)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs (bool) + top_logprobs (0..20, needs logprobs). Completions: logprobs (0..5),
    the number of alternatives, 0 meaning the chosen token's own log-prob only."""
    if chat:
        wanted = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, TOP_LOGPROBS_MAX)
        if top is not None and not wanted:
            raise bad("top_logprobs", "needs logprobs: true")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    if value is None or value is False:  # some clients send false for "none"
        return None
    return _int(body, "logprobs", None, 0, COMPLETION_LOGPROBS_MAX)


def _model(body: dict) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise bad("model", "must be a string")
    return value


def parse_sampling(body: dict, default_max_tokens: int | None = None, chat: bool = True) -> Sampling:
    """default_max_tokens None: the room left in the context (resolved once the prompt is known)."""
    _refuse_unsupported(body)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    include_usage = bool(options and _bool(options, "include_usage", False, "stream_options."))
    # max_completion_tokens is the chat API's newer name for max_tokens.
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return Sampling(
        max_tokens=_int(body, key, default_max_tokens, 1, 1 << 20),
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        # No seed: fresh entropy, so "regenerate" gives another answer; the seed drawn is reported.
        seed=_int(body, "seed", None, 0, SEED_MAX) if body.get("seed") is not None else secrets.randbelow(SEED_MAX + 1),
        stop=_stop(body), stream=stream, include_usage=include_usage,
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, -PENALTY_MAX, PENALTY_MAX),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, REPETITION_MAX, lo_open=True),
        logit_bias=_logit_bias(body), logprobs=_logprobs(body, chat), n=_int(body, "n", 1, 1, N_MAX))


def parse_completion(body, default_max_tokens: int | None = None) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("prompt", "must be a string, a list with one string, or a non-empty list of token ids")
    elif not isinstance(prompt, str):
        raise bad("prompt", "is required: a string or a list of token ids")
    return CompletionRequest(_model(body), prompt, parse_sampling(body, default_max_tokens, chat=False))


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:  # null content goes with an assistant's tool_calls only (chat_message)
        raise bad(f"messages[{i}].content", "is required: a string or a list of text parts (null is not)")
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body, default_max_tokens: int | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "is required: a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        clean.append(chat_message(m, role, i))
    try:
        tools = parse_tool_fields(body)
    except FieldError as exc:
        raise bad(exc.param, exc.message) from None
    name_tool_results(clean)
    # `tools` is refused by parse_sampling for /v1/completions, which has no tools; here it is served.
    sampling = parse_sampling({k: v for k, v in body.items() if k != "tools"}, default_max_tokens)
    return ChatRequest(_model(body), clean, sampling, tools)


def chat_message(m: dict, role: str, i: int) -> dict:
    """One history message as the template reads it: an assistant's `tool_calls` (its content may
    then be null, kept as None as transformers passes it) and a tool result's `tool_call_id`."""
    try:
        if role == "assistant" and m.get("tool_calls") not in (None, []):
            content = m.get("content")
            return {"role": role, "content": None if content is None else _content_text(content, i),
                    "tool_calls": parse_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")}
    except FieldError as exc:
        raise bad(exc.param, exc.message) from None
    out = {"role": role, "content": _content_text(m.get("content"), i)}
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key}", "must be a string")
                out[key] = m[key]
    return out
