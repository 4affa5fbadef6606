"""`colibri chat`: a terminal conversation with the model, on the same engine and worker as serve.

The answer streams as it is generated; after each one a speed line says what it cost (tokens,
time to first token, decode speed, expert-cache hit rate). The history is kept and re-sent
through the chat template each turn; when it no longer fits the context, the oldest turns go
first (a system prompt stays). Ctrl-C stops the answer being generated; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import sys
import threading

from colibri.serve.protocol import Sampling
from colibri.serve.worker import Job, JobResult

HELP = "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


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


def chat_loop(model, sampling: Sampling, system: str | None = None, read=input, out=sys.stdout) -> int:
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
            out.write("\n")
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
        answer = _answer(model, ids, sampling, out)
        out.write("\n" + speed_line(answer, model.engine.io_stats().get("hit_rate")) + "\n")
        out.flush()
        history.append({"role": "assistant", "content": answer.text})


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
            done.wait()
            return box[0]
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            job.cancelled.set()
