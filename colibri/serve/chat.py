"""`colibri chat`: a terminal conversation with the model, on the same engine and worker as serve.

The answer streams as it is generated; after each one a speed line says what it cost (tokens,
time to first token, decode speed, and the RAM expert cache's hit rate over that answer's
lookups, not since start). The history is kept and re-sent through the chat template each turn;
when it no longer fits the context, the oldest turns go first (a system prompt stays). Ctrl-C
stops the answer being generated; at the prompt it clears the line (no empty "you>" line left
behind); Ctrl-D or /exit quits.
"""

from __future__ import annotations

import select
import sys
import threading

from colibri.serve.protocol import Sampling
from colibri.serve.worker import Job, JobResult

HELP = "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"
CLEAR_LINE = "\r\x1b[2K"  # back to the line's start and erase it (ECMA-48 EL 2)
# Ctrl-C's SIGINT may be delivered to any thread of the process (the worker's, torch's), and then
# a main thread blocked in read() or an untimed wait never sees it: Python runs its handler only
# when the main thread wakes. Waiting in slices lets it wake and raise KeyboardInterrupt.
SLICE_S = 0.1


def read_line(prompt: str) -> str:
    """input() that a Ctrl-C interrupts at once, whichever thread the signal lands on. A terminal
    hands over one line per read (canonical mode), so nothing waits in Python's buffer unseen by
    select; a pipe may hold several lines there, so it is read with input() itself."""
    if not sys.stdin.isatty():
        return input(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], SLICE_S)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def hit_counts(stats: dict) -> tuple[int, dict[str, int]]:
    """(expert lookups, hits per cache tier) since start, from the store's stats."""
    n = stats.get("expert_lookups")
    if not isinstance(n, int):
        return 0, {}
    return n, {t: round(r * n) for t, r in (stats.get("hit_rate") or {}).items() if r is not None}


def answer_hit_rate(before: tuple[int, dict], after: tuple[int, dict]) -> dict[str, float]:
    """Each tier's hit rate over the lookups between two hit_counts: one answer's."""
    lookups = after[0] - before[0]
    if lookups <= 0:
        return {}
    return {t: (hits - before[1].get(t, 0)) / lookups for t, hits in after[1].items()}


def speed_line(result: JobResult, hit_rate: dict | None) -> str:
    gen = result.generation
    n = len(result.output_ids)
    if gen is None:
        return f"[{n} tokens]"
    decode = sum(gen.token_seconds)
    parts = [f"{n} tokens", f"TTFT {gen.ttft_seconds:.2f} s"]
    if decode > 0:
        parts.append(f"{len(gen.token_seconds) / decode:.1f} tok/s decode")
    ram = (hit_rate or {}).get("ram")
    if ram is not None:
        parts.append(f"RAM hit {ram:.0%}")
    if result.finish_reason not in ("stop", "length"):
        parts.append(result.finish_reason)
    return "[" + ", ".join(parts) + "]"


def _fit(model, history: list[dict], max_tokens: int) -> list[int] | None:
    """The prompt ids of the history, dropping the oldest non-system turns until it fits."""
    while True:
        prompt = model.template.render(history, add_generation_prompt=True)
        ids = model.tokenizer.encode(prompt, add_special_tokens=False).ids
        if len(ids) + max_tokens <= model.worker.ctx_size:
            return ids
        droppable = [i for i, m in enumerate(history[:-1]) if m["role"] != "system"]
        if not droppable:
            return None
        del history[droppable[0]]


def chat_loop(model, sampling: Sampling, system: str | None = None, read=read_line, out=sys.stdout) -> int:
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    out.write(f"colibri chat: {model.model_dir.name} (context {model.worker.ctx_size} tokens). {HELP}\n")
    out.flush()
    while True:
        try:
            line = read("you> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            # A terminal erases the interrupted prompt line and redraws it; elsewhere, a new line.
            out.write(CLEAR_LINE if _is_tty(out) else "\n")
            continue
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            del history[1 if system else 0:]
            out.write("(history cleared)\n")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        ids = _fit(model, history, sampling.max_tokens)
        if ids is None:
            history.pop()
            out.write(f"(that message alone does not fit the context of {model.worker.ctx_size} tokens)\n")
            continue
        before = hit_counts(model.engine.io_stats())
        answer = _answer(model, ids, sampling, out)
        rate = answer_hit_rate(before, hit_counts(model.engine.io_stats()))
        out.write("\n" + speed_line(answer, rate) + "\n")
        out.flush()
        history.append({"role": "assistant", "content": answer.text})


def _is_tty(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def _answer(model, ids: list[int], sampling: Sampling, out) -> JobResult:
    done = threading.Event()
    box: list[JobResult] = []

    def emit(kind, value):
        if kind == "text":
            out.write(value)
            out.flush()
        else:
            box.append(value)
            done.set()

    job = Job(ids, sampling, emit)
    out.write("model> ")
    out.flush()
    model.worker.submit(job)
    while True:
        try:
            while not done.wait(SLICE_S):  # in slices: see SLICE_S
                pass
            return box[0]
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            job.cancelled.set()
