"""The HTTP side of `colibri serve`: OpenAI's routes on Starlette (served by uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (both streamed with server-sent events
when asked; chat with tools through colibri/serve/tools/), GET /v1/models, GET /v1/models/{id},
GET /health, GET /metrics, and Anthropic's POST /v1/messages (colibri/serve/anthropic.py). Every
request body is size-limited and validated (colibri/serve/protocol.py); every refusal is an OpenAI
error object. When an API key is set, every route but /health needs `Authorization: Bearer <key>`
(the scheme in any case, as RFC 7235 says), the key compared in constant time. Every generation's
answer names the seed it sampled with (header `x-colibri-seed` and a top-level `seed` field), so a
request without one can be replayed. Browsers: CORS only for the origins --cors-origin names.

When the server is told to stop (SIGINT / SIGTERM), `ServeState.shut_down` ends every open
request at once: a stream gets an error event and [DONE], a waiting request a 503, and the
generation stops at its next token, so uvicorn's graceful wait ends well before its timeout
(it used to cancel the streams there, logging CancelledError tracebacks mid-chunk).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.api import ColibriError, loads_limited
from colibri.serve.anthropic import anthropic_error, check_key, count_tokens_endpoint, messages_endpoint
from colibri.serve.prometheus import ServerMetrics
from colibri.serve.protocol import ApiError, Sampling, parse_chat, parse_completion
from colibri.serve.jobrun import SHUTDOWN, Bridge
from colibri.serve.shapes import ChatShape, CompletionShape, TokenText, usage
from colibri.serve.structured import parse_response_format
from colibri.serve.tools.chat import tool_chat_completion
from colibri.serve.tools.constrain import Marks
from colibri.serve.worker import GenerationWorker, Job

DEFAULT_MAX_BODY = 4 << 20


class ServeState:
    """What every handler shares: the one worker, the model's identity, the limits."""

    def __init__(self, worker: GenerationWorker, tokenizer, template, model_id: str, *, api_key: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY, metrics: ServerMetrics | None = None,
                 cors_origins: tuple[str, ...] = ()):
        self.worker, self.tokenizer, self.template, self.model_id = worker, tokenizer, template, model_id
        self.api_key, self.max_body, self.cors_origins = api_key, max_body, tuple(cors_origins)
        self.metrics = metrics or worker.metrics
        self.created = int(time.time())
        self.token_text = TokenText(tokenizer)
        self.open: set[Bridge] = set()  # the requests waiting on the worker, told when the server stops
        self.stopping = False
        self._marks: Marks | None = None

    def tool_marks(self) -> Marks:
        """The tokenizer's markers for tool-call grammars (its added tokens), read once."""
        if self._marks is None:
            self._marks = Marks.of(self.tokenizer, self.worker.eos_ids)
        return self._marks

    def shut_down(self) -> None:
        """Called from a signal handler (on the event loop's thread, between its steps): every
        open request learns through its bridge, which only schedules a call on the loop."""
        self.stopping = True
        for bridge in list(self.open):
            bridge.emit("shutdown", None)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        # The server saw the body's framing break (bad chunk sizes, a body shorter than its
        # Content-Length) and dropped the connection: nobody reads this answer, but the handler
        # ends as a refusal, not as an "Exception in ASGI application" traceback in the log.
        raise ApiError(400, "the request body's framing is broken (chunked encoding or Content-Length)") from None
    try:
        body = loads_limited(b"".join(chunks), "the request body", max_bytes=limit, error=ColibriError)
    except ColibriError as exc:
        raise ApiError(400, str(exc)) from None
    _check_unicode(body)
    return body


def _check_unicode(body) -> None:
    """JSON's \\ud800 escapes decode to lone UTF-16 surrogates, which are not text: the tokenizer
    raised on them (HTTP 500 and a traceback). Refused here for every string of the body, keys
    included: one re-encoding of a body of at most max_body bytes."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode("ascii")
        raise ApiError(400, f"the request body holds a lone UTF-16 surrogate ({bad}) in a string: "
                            "not text a tokenizer can take") from None


def build_app(state: ServeState) -> Starlette:
    metrics = state.metrics

    def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        ok = hmac.compare_digest(given.strip().encode(), state.api_key.encode())  # constant time, always run
        if not (ok and scheme.lower() == "bearer"):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_id:
            raise ApiError(404, f"model {name!r} is not served here (this server serves {state.model_id!r})",
                           param="model", code="model_not_found")

    async def run_job(request: Request, prompt_ids: list[int], sampling: Sampling, shape) -> Response:
        state.worker.check_fits(prompt_ids, sampling)  # also sets a missing max_tokens to the room left
        if state.stopping:
            raise SHUTDOWN
        bridge = Bridge()
        job = Job(prompt_ids, sampling, bridge.emit)
        state.worker.submit(job)
        state.open.add(bridge)
        ident = shape.new_id()
        headers = {"x-colibri-seed": str(sampling.seed)}
        if sampling.stream:
            return StreamingResponse(_sse(job, bridge, shape, ident, sampling), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})
        try:
            return await _whole(request, job, bridge, shape, ident, sampling, headers)
        finally:
            state.open.discard(bridge)

    async def _whole(request, job, bridge, shape, ident, sampling, headers) -> Response:
        text: list[str] = []
        logprobs: list | None = [] if sampling.logprobs is not None else None
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.ensure_future(bridge.events.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    job.cancelled.set()
                    return Response(status_code=499)
                kind, value = getter.result()
                if kind == "text":
                    text.append(value)
                    continue
                if kind == "logprob":
                    logprobs.append(value)
                    continue
                if kind == "shutdown":
                    job.cancelled.set()
                    raise SHUTDOWN
                if value.finish_reason == "error":
                    raise ApiError(500, f"generation failed: {value.error}", type="server_error")
                return JSONResponse(shape.whole(ident, "".join(text), value, state, sampling.seed,
                                                logprobs[:len(value.output_ids)] if logprobs is not None else None),
                                    headers=headers)
        finally:
            gone.cancel()

    async def _sse(job, bridge, shape, ident, sampling):
        seed = sampling.seed
        pending: list = []  # log-probs of tokens whose text is not sent yet (held back, or split characters)
        try:
            opening = shape.chunk(ident, None, None, state, seed, first=True)
            if opening is not None:
                yield _event(opening)
            while True:
                kind, value = await bridge.events.get()
                if kind == "logprob":
                    pending.append(value)
                    continue
                if kind == "text":
                    yield _event(shape.chunk(ident, value, None, state, seed, logprobs=pending))
                    pending = []
                    continue
                if kind == "shutdown":
                    job.cancelled.set()
                    yield _event(SHUTDOWN.body())
                elif value.finish_reason == "error":
                    yield _event(ApiError(500, f"generation failed: {value.error}", type="server_error").body())
                else:
                    # tokens whose text never came (cut by a stop sequence) keep their log-probs, as usage counts them
                    yield _event(shape.chunk(ident, None, value.finish_reason, state, seed, logprobs=pending))
                    if sampling.include_usage:
                        yield _event({**shape.chunk(ident, None, None, state, seed), "choices": [],
                                      "usage": usage(value)})
                yield "data: [DONE]\n\n"
                return
        finally:
            # The client went away (the response task is cancelled) or the stream ended: either
            # way the generation must not run on for nobody.
            job.cancelled.set()
            state.open.discard(bridge)

    async def completions(request: Request) -> Response:
        authorized(request)
        body = await _read_json(request, state.max_body)
        req = parse_completion(body)
        structured = parse_response_format(body)
        req.sampling.grammar = structured.grammar if structured else None
        check_model(req.model)
        ids = list(req.prompt) if isinstance(req.prompt, list) else state.tokenizer.encode(req.prompt).ids
        return await run_job(request, ids, req.sampling, CompletionShape)

    async def chat_completions(request: Request) -> Response:
        authorized(request)
        body = await _read_json(request, state.max_body)
        req = parse_chat(body)
        structured = parse_response_format(body)
        if structured:
            req.sampling.grammar, req.response_schema = structured.grammar, structured.schema
        check_model(req.model)
        if req.tools.engaged:  # tools in the prompt, calls parsed from the answer: colibri/serve/tools/
            return await tool_chat_completion(request, state, req)
        try:
            prompt = state.template.render(req.messages, add_generation_prompt=True)
        except ColibriError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        ids = state.tokenizer.encode(prompt, add_special_tokens=False).ids
        return await run_job(request, ids, req.sampling, ChatShape)

    def anthropic(endpoint):
        # Anthropic's routes answer with Anthropic error objects from the first check on.
        async def handler(request: Request) -> Response:
            try:
                check_key(request, state.api_key)
                body = await _read_json(request, state.max_body)
            except ApiError as exc:
                return anthropic_error(exc)
            return await endpoint(request, state, body)
        return handler

    def model_object() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "colibri",
                "ctx_size": state.worker.ctx_size, "chat_template": state.template.source}

    async def models(request: Request) -> Response:
        authorized(request)
        return JSONResponse({"object": "list", "data": [model_object()]})

    async def one_model(request: Request) -> Response:
        authorized(request)
        name = request.path_params["model_id"]
        if name != state.model_id:
            raise ApiError(404, f"model {name!r} is not served here (this server serves {state.model_id!r})",
                           param="model", code="model_not_found")
        return JSONResponse(model_object())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "busy": state.worker.busy, "queue": state.worker.queue_length()})

    async def prometheus(request: Request) -> Response:
        authorized(request)
        engine = state.worker.engine
        text = metrics.render(state.worker.queue_length(), state.worker.busy, engine.io_stats(), engine.prefix_stats(),
                              engine.draft_stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def counted(route: str, handler):
        async def wrapped(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as exc:
                response = _error(exc)
            except ColibriError as exc:  # the input's fault by definition (a prompt the tokenizer refused)
                response = _error(ApiError(400, str(exc)))
            metrics.count_request(route, response.status_code)
            return response
        return wrapped

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    routes = [
        Route("/v1/completions", counted("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", counted("/v1/chat/completions", chat_completions), methods=["POST"]),
        Route("/v1/models", counted("/v1/models", models), methods=["GET"]),
        # :path, so an id with a slash (org/name, as clients copy it from a hub) is one id
        Route("/v1/models/{model_id:path}", counted("/v1/models/{id}", one_model), methods=["GET"]),
        Route("/v1/messages", counted("/v1/messages", anthropic(messages_endpoint)), methods=["POST"]),
        Route("/v1/messages/count_tokens", counted("/v1/messages/count_tokens", anthropic(count_tokens_endpoint)),
              methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", counted("/metrics", prometheus), methods=["GET"]),
    ]
    # Off unless origins are named: a page on any site could otherwise drive a local model server
    # that has no key. The seed header is exposed so a browser client can replay a generation.
    middleware = [Middleware(CORSMiddleware, allow_origins=list(state.cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"], expose_headers=["x-colibri-seed"])
                  ] if state.cors_origins else []
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found}, middleware=middleware)


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the next ASGI message on this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
