"""POST /v1/chat/completions with `tools`: the prompt rendered with the tools through the model's
chat template, the answer parsed back into OpenAI `tool_calls`, whole or streamed.

Streamed, a call's first delta has its index, id, type and name (arguments ""), and its arguments
follow in pieces as the model writes them, as OpenAI streams them (Hermes, DeepSeek-V3 and harmony
calls, once their arguments' object opens: colibri/serve/tools/base.py); a call read only at its
block's end (GLM's key/value pairs, a head no pattern reads) sends its arguments in one piece.

Log-probs (`logprobs`, `top_logprobs`) are those of every generated token, call syntax and markers
included (the model's own, as on the route without tools: colibri/serve/shapes.py); streamed, the
tokens' entries ride on the first chunk sent after them (a call's head, an arguments piece, content,
or the finish chunk for tokens the parser still held), so every counted token is reported once.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.api import ColibriError
from colibri.serve.jobrun import SHUTDOWN, JobRun
from colibri.serve.shapes import chat_logprobs, usage
from colibri.serve.protocol import ApiError, ChatRequest, bad
from colibri.serve.tools import detect_format
from colibri.serve.tools.constrain import tool_grammar
from colibri.serve.tools.request import FieldError
from colibri.serve.tools.output import ToolOutput, whole


def tool_prompt(state, req: ChatRequest, param: str = "tools") -> tuple[list[int], ToolOutput]:
    """The prompt's token ids with the offered tools rendered, and the answer's parser; the calls'
    grammar, when the request asks for one, goes into its sampling (colibri/serve/tools/constrain.py)."""
    fmt = detect_format(state.template.text)
    if fmt is None:
        raise ApiError(400, f"{param}: this model's chat template ({state.template.source}) has no tool-call "
                            "format this server parses (Hermes <tool_call>, DeepSeek-V3, GLM-4.5, gpt-oss harmony)",
                       param=param)
    offered = req.tools.offered()
    try:
        prompt = state.template.render(req.messages, add_generation_prompt=True, tools=offered)
    except ColibriError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    ids = state.tokenizer.encode(prompt, add_special_tokens=False).ids
    try:
        grammar = tool_grammar(fmt, req.tools, state.tool_marks(), req.response_schema)
    except FieldError as exc:
        raise bad(exc.param, exc.message) from None
    if grammar is not None:
        req.sampling.grammar = grammar
    return ids, ToolOutput(fmt.new_parser(offered), req.tools)


def openai_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


async def tool_chat_completion(request, state, req: ChatRequest) -> Response:
    if req.sampling.n != 1:  # one parsed answer per request on this route: refused by name
        raise ApiError(400, "n: one choice per request when tools are offered (send n requests)", param="n")
    ids, output = tool_prompt(state, req)
    run = JobRun(state, ids, req.sampling, special_text=True)
    ident, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", state.model_id
    seed = req.sampling.seed  # named in every answer, as the other routes do, so it can be replayed
    headers = {"x-colibri-seed": str(seed)}
    if req.sampling.stream:
        return StreamingResponse(_sse(run, output, ident, model, req.sampling.include_usage, seed, state.token_text),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    got = await run.collect(request)
    if got is None:
        return Response(status_code=499)
    text, result = got
    if result.finish_reason == "error":
        raise ApiError(500, f"generation failed: {result.error}", type="server_error")
    content, calls = whole(output, text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [openai_call(c) for c in calls]
    logprobs = (chat_logprobs(run.logprobs[:len(result.output_ids)], state.token_text)
                if req.sampling.logprobs is not None else None)
    return JSONResponse({"id": ident, "object": "chat.completion", "created": int(time.time()), "model": model,
                         "seed": seed, "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                                    "finish_reason": output.finish_reason(result.finish_reason)}],
                         "usage": usage(result)}, headers=headers)


class ChunkMaker:
    """Chat completion chunks for one streamed answer (pure: tested without a server)."""

    def __init__(self, ident: str, model: str, seed: int | None = None, token_text=None):
        """token_text: the server's TokenText, when the request asked for log-probs."""
        self.ident, self.model, self.created, self.seed = ident, model, int(time.time()), seed
        self.index = 0
        self.indices: dict[str, int] = {}  # call id → its index in tool_calls
        self.token_text = token_text
        self.pending: list = []  # log-prob entries of tokens whose text no chunk has carried yet

    def logprob(self, entry) -> None:
        """A generated token's (TokenLogprob, text offset): sent with the next chunk."""
        self.pending.append(entry)

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        lp = None
        if self.pending and self.token_text is not None:
            lp, self.pending = chat_logprobs(self.pending, self.token_text), []
        return {"id": self.ident, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                **({"seed": self.seed} if self.seed is not None else {}),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]}

    def opening(self) -> dict:
        return self.chunk({"role": "assistant", "content": ""})

    def events(self, events: list[tuple]) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(self.chunk({"content": value}))
            elif kind in ("call", "call_begin"):
                head = openai_call(value, self.index)
                head["function"] = {"name": value.name, "arguments": ""}
                out.append(self.chunk({"tool_calls": [head]}))
                self.indices[value.id] = self.index
                self.index += 1
                if kind == "call":
                    out.append(self._arguments(value, value.arguments))
            elif kind == "call_args":
                out.append(self._arguments(*value))
        return out

    def _arguments(self, call, piece: str) -> dict:
        return self.chunk({"tool_calls": [{"index": self.indices[call.id], "function": {"arguments": piece}}]})


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(run: JobRun, output: ToolOutput, ident: str, model: str, include_usage: bool, seed: int,
               token_text=None):
    maker = ChunkMaker(ident, model, seed, token_text)
    try:
        yield _event(maker.opening())
        while True:
            kind, value = await run.next()
            if kind == "logprob":
                maker.logprob(value)
                continue
            if kind == "text":
                for chunk in maker.events(output.feed(value)):
                    yield _event(chunk)
                continue
            if kind == "shutdown":
                yield _event(SHUTDOWN.body())
            elif value.finish_reason == "error":
                yield _event(ApiError(500, f"generation failed: {value.error}", type="server_error").body())
            else:
                for chunk in maker.events(output.finish()):
                    yield _event(chunk)
                yield _event(maker.chunk({}, output.finish_reason(value.finish_reason)))
                if include_usage:
                    yield _event({**maker.chunk({}), "choices": [], "usage": usage(value)})
            yield "data: [DONE]\n\n"
            return
    finally:
        # The client went away or the stream ended: the generation must not run on for nobody.
        run.cancel()
