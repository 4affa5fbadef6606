"""One generation on the worker, seen from a request handler's event loop: submit, then read its
events (("text", piece) ... ("done", JobResult)) as they come, or collect them all while watching
for the client leaving. The routes of colibri/serve/tools/chat.py and colibri/serve/anthropic.py use
JobRun; app.py's own OpenAI routes read a Bridge with their own loops (log-probs, shutdown).
"""

from __future__ import annotations

import asyncio

from colibri.serve.protocol import Sampling
from colibri.serve.worker import Job, JobResult


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
    def __init__(self, worker, prompt_ids: list[int], sampling: Sampling, special_text: bool = False):
        worker.check_fits(prompt_ids, sampling)  # also sets a missing max_tokens to the room left
        super().__init__()
        self.job = Job(prompt_ids, sampling, self.emit, special_text=special_text)
        worker.submit(self.job)

    def emit(self, kind, value) -> None:  # on the worker thread
        if kind == "logprob":  # these routes report no log-probs (the tools route refuses the field)
            return
        super().emit(kind, value)

    async def next(self) -> tuple[str, object]:
        return await self.events.get()

    def cancel(self) -> None:
        self.job.cancelled.set()

    async def collect(self, request) -> tuple[str, JobResult] | None:
        """All the text and the result; None when the client left first (the job is cancelled)."""
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
                else:
                    return "".join(text), value
        finally:
            gone.cancel()


async def _wait_disconnect(request) -> None:
    # After the body is read, the next ASGI message on this request is its disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
