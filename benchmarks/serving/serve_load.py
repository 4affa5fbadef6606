"""Clients that load a running `colibri serve` (serve_client.py's helpers, not a command).

- `streamed`: one streamed request timed at the client (TTFT = its first text chunk).
- `simultaneous`: N requests released together from N threads, each on its own kept-alive
  connection (opened before the release, so no connect is timed): simultaneous arrivals.
- `TraceLoad`: a request trace (engine/run/request_trace.py) sent at its arrival times, over and
  over for a duration, each request on a worker thread of its own; 503 (queue full) is counted as
  the refusal serve answers by design, anything else as an error.
- `log_requests`: the server's per-request log lines (wait, TTFT from admission) as figures.
- `percentile`, `rounded`: the figures as the tables quote them.

Timings here are the client's: the figures a user of `serve` sees.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx

PROMPT = "The streaming engine reads the routed experts of each layer from the disk, and"


def streamed(http: httpx.Client, tokens: int, prompt: str | list[int] = PROMPT, chat: bool = False,
             seed: int | None = None, temperature: float = 0.0, n: int = 1) -> dict:
    """One streamed request, timed at the client: TTFT at the first text chunk (of any choice), decode
    from it to the stream's end over the tokens after the first. `prompt` may be token ids
    (/v1/completions takes them as they are)."""
    body = {"model": "bench", "max_tokens": tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, **({"seed": seed} if seed is not None else {}),
            **({"n": n} if n != 1 else {})}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    t0 = time.perf_counter()
    times, usage = [], None
    with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        r.raise_for_status()
        for data in sse_data(r):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or ():
                if (c.get("delta") or {}).get("content") or c.get("text"):
                    times.append(time.perf_counter() - t0)
                    break
    wall = time.perf_counter() - t0
    n_tokens = usage["completion_tokens"] if usage else len(times)
    # From the first chunk to the stream's end: text held back (a partial character, a possible
    # stop) arrives later in a bunch, so the last chunk's time would undercount the decode. With
    # n > 1 the choices decode together: per choice, tokens / n over the same span.
    per_choice = n_tokens / max(1, n)
    decode = (wall - times[0]) / (per_choice - 1) if times and per_choice > 1 else None
    return {"ttft_s": times[0] if times else None, "s_per_token": decode, "tokens": n_tokens, "wall_s": wall}


def sse_data(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, its lines split at LF (CR LF) only, as
    the SSE format says: httpx's iter_lines also splits at U+2028, U+0085 and the other
    str.splitlines breaks, which a JSON payload carries raw (serve writes ensure_ascii=False), and
    a sampled answer's text holds them now and then."""
    buf = b""
    for piece in response.iter_bytes():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].rstrip(b"\r").decode("utf-8")


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's default):
    with few samples p95 lies between the two largest, not at the largest alone."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    at = (len(vals) - 1) * q / 100
    lo, hi = math.floor(at), math.ceil(at)
    return vals[lo] + (vals[hi] - vals[lo]) * (at - lo)


def rounded(v: float | None, digits: int = 3) -> float | None:
    """A figure as the tables and JSON quote it: rounded, None kept."""
    return None if v is None else round(v, digits)


def simultaneous(base: str, prompts: list, tokens: int, timeout: float = 600.0) -> list[dict]:
    """len(prompts) greedy streamed requests released at once, one thread and one connection each;
    each result gets its send time relative to the release (`sent_s`). The first failure is raised
    once all have ended."""
    clients = [httpx.Client(base_url=base, timeout=timeout) for _ in prompts]
    results: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    try:
        for c in clients:  # the connection is open before the release: a request times no connect
            c.get("/health").raise_for_status()
        release = threading.Barrier(len(prompts) + 1)
        t0 = [0.0]

        def one(i: int) -> None:
            release.wait()
            sent = time.perf_counter() - t0[0]
            try:
                results[i] = {"sent_s": sent, **streamed(clients[i], tokens, prompts[i])}
            except BaseException as exc:  # noqa: BLE001  re-raised below, after every thread has ended
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        t0[0] = time.perf_counter()
        release.wait()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    if errors:
        raise errors[0]
    return results


LOG_LINE = re.compile(r"colibri serve: request (\d+)(?: choice \d+)?: (\d+) prompt tokens \((\d+) cached\), "
                      r"wait ([\d.]+) s, TTFT ([\d.]+) s, (\d+) tokens")


def log_requests(text: str) -> list[dict]:
    """The server log's per-sequence lines (colibri/serve/worker.py _log_line): its queue wait and
    TTFT from admission, so wait + TTFT is the engine's time to first token from the request's arrival."""
    out = []
    for m in LOG_LINE.finditer(text):
        wait_s, ttft = float(m.group(4)), float(m.group(5))
        out.append({"request": int(m.group(1)), "prompt_tokens": int(m.group(2)), "cached": int(m.group(3)),
                    "wait_s": wait_s, "ttft_s": ttft, "arrival_to_first_s": wait_s + ttft,
                    "tokens": int(m.group(6))})
    return out


class TraceLoad:
    """A trace's requests sent at their `at` (seconds into a cycle), cycle after cycle: the next cycle
    starts `gap` seconds after the last request of the one before has ended (so a server slower than
    the trace is loaded in bursts, not buried under a queue that only grows). Sampled every `every`
    seconds through `sample(t_s, done)` (done: the results since the last sample) on this thread.
    Greedy unless `temperature` > 0 (then a per-request seed)."""

    def __init__(self, base: str, lines: list, gap: float = 1.0, temperature: float = 0.0, workers: int = 64,
                 timeout: float = 600.0):
        self.base, self.lines, self.gap, self.temperature, self.timeout = base, lines, gap, temperature, timeout
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trace-client")
        self.local = threading.local()
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.sent = 0
        self.cycles = 0
        self._clients: list[httpx.Client] = []

    def _client(self) -> httpx.Client:
        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = httpx.Client(base_url=self.base, timeout=self.timeout)
            with self.lock:
                self._clients.append(c)
        return c

    def _one(self, index: int, line, t0: float) -> None:
        prompt = list(line.prompt_ids) if line.prompt_ids is not None else line.prompt
        row = {"request": index, "line": line.line, "n": line.n, "sent_s": round(time.monotonic() - t0, 3)}
        try:
            r = streamed(self._client(), line.max_tokens, prompt, n=line.n, temperature=self.temperature,
                         seed=index if self.temperature > 0 else None)
            row.update(status="ok", **r)
        except httpx.HTTPStatusError as exc:
            row["status"] = str(exc.response.status_code)
        except Exception as exc:  # noqa: BLE001  counted, not fatal: a soak reports what went wrong
            row.update(status="error", error=f"{type(exc).__name__}: {exc}")
        with self.lock:
            self.results.append(row)

    def run(self, seconds: float, every: float, sample) -> None:
        t0 = time.monotonic()
        taken = 0  # results handed to sample() so far
        next_sample, cycle_start, i, cycle = 0.0, 0.0, 0, []
        end = seconds

        def hand_over(now: float) -> None:
            nonlocal taken
            with self.lock:
                done = self.results[taken:]
                taken = len(self.results)
            sample(now, done)

        try:
            while (now := time.monotonic() - t0) < end:
                if now >= next_sample:
                    hand_over(now)
                    next_sample += every
                    continue
                if i < len(self.lines):
                    due = cycle_start + self.lines[i].at
                    if now >= due:
                        cycle.append(self.pool.submit(self._one, self.sent, self.lines[i], t0))
                        self.sent += 1
                        i += 1
                        continue
                    time.sleep(max(0.0, min(due, next_sample, end) - now))  # pacing the arrivals, not a sync
                    continue
                left = [f for f in cycle if not f.done()]
                if left:
                    wait(left, timeout=max(0.0, min(next_sample, end) - now), return_when=FIRST_COMPLETED)
                    continue
                self.cycles += 1
                cycle, i = [], 0
                cycle_start = now + self.gap
        finally:
            self.pool.shutdown(wait=True)  # the requests in flight end (the duration is not cut short by them)
            for c in self._clients:
                c.close()
        hand_over(time.monotonic() - t0)
