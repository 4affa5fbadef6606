"""One generation on the worker, seen from a request handler's event loop: submit, then read its
events (("text", piece) ... ("done", JobResult)) as they come, or collect them all while watching
for the client leaving. The routes of colibri/serve/tools/chat.py and colibri/serve/anthropic.py use
JobRun; app.py's own OpenAI routes read a Bridge with their own loops (n > 1 choices). When the
sampling asks for log-probs, ("logprob", (TokenLogprob, text offset)) events come before the text
of their token: `next` hands them over, `collect` gathers them in `logprobs`.

Every open run is in the server state's `open` set, so a stop signal reaches it
(ServeState.shut_down): it reads ("shutdown", None), which a stream answers with its route's error
event and a whole answer with SHUTDOWN (503), and the generation stops at its next token.
"""

from __future__ import annotations

import asyncio

from colibri.serve.protocol import ApiError, Sampling
from colibri.serve.worker import Job, JobResult

SHUTDOWN = ApiError(503, "the server is shutting down: this generation was stopped", type="server_error",
                    code="server_shutdown")


class Bridge:
    """Events from the worker thread into a request's event loop (the OpenAI routes' and JobRun's)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()

    def emit(self, kind, value) -> None:  # on the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone (server shutting down): nobody is listening
            pass


class JobRun(Bridge):
    def __init__(self, state, prompt_ids: list[int], sampling: Sampling, special_text: bool = False):
        state.worker.check_fits(prompt_ids, sampling)  # also sets a missing max_tokens to the room left
        if state.stopping:
            raise SHUTDOWN
        super().__init__()
        self.state = state
        self.logprobs: list = []  # collect's ("logprob", entry) values, in token order
        self.job = Job(prompt_ids, sampling, self.emit, special_text=special_text)
        state.worker.submit(self.job)
        state.open.add(self)

    async def next(self) -> tuple[str, object]:
        return await self.events.get()

    def cancel(self) -> None:
        """The run is over for its reader (ended, client gone, server stopping): the generation
        stops at its next token and the server no longer waits on it."""
        self.job.cancelled.set()
        self.state.open.discard(self)

    async def collect(self, request) -> tuple[str, JobResult] | None:
        """All the text and the result (the log-prob entries, when asked, in `logprobs`); None when
        the client left first (the job is cancelled); SHUTDOWN raised when the server is stopping."""
        text: list[str] = []
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.ensure_future(self.events.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    self.cancel()
                    return None
                kind, value = getter.result()
                if kind == "text":
                    text.append(value)
                elif kind == "logprob":
                    self.logprobs.append(value)
                elif kind == "shutdown":
                    raise SHUTDOWN
                else:
                    return "".join(text), value
        finally:
            gone.cancel()
            self.cancel()


async def _wait_disconnect(request) -> None:
    # After the body is read, the next ASGI message on this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
