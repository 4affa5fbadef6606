"""A request trace: when requests arrive, what they ask and how much they generate (`bench --trace`,
`tune --objective serve --trace`; replayed by engine/run/trace_replay.py).

    trace = read_trace("chat_burst.jsonl")               # checked, not yet tokenized
    requests = tokenize_trace(trace, tokenizer, vocab)   # TraceRequest with prompt ids

The file is JSON Lines, one request per line, in arrival order:

    {"at": 0.0, "prompt_ids": [17, 4, 250], "max_tokens": 32}
    {"at": 0.0, "prompt": "Summarise this for me", "max_tokens": 16, "n": 2}
    {"at": 1.5, "prompt_ids": [9, 9, 12, 30], "max_tokens": 64}

  at          seconds since the replay started, a finite number >= 0, never less than the line
              before's (arrivals in order: the replay submits them in file order)
  prompt      text, tokenized with the model's tokenizer.json, or
  prompt_ids  the token ids themselves (a trace that means the same tokens on every model);
              exactly one of the two
  max_tokens  output tokens the request asks for, an integer in [1, MAX_NEW_TOKENS] (the OpenAI
              name; greedy decoding runs every request to this length unless a stop id ends it)
  n           optional: sequences sharing the prompt (OpenAI's n), in [1, MAX_N]; default 1

The file is untrusted: a regular file of at most MAX_FILE_BYTES, UTF-8, at most MAX_REQUESTS
requests, each line one JSON object within the JSON limits (engine/base/jsonlimits.py); blank
lines are skipped. The first problem is one PromptError naming `--trace FILE:LINE` and what is
wrong; nothing is replayed until the whole file has passed.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.base.durable import atomic_write_text
from engine.base.errors import PromptError
from engine.base.jsonlimits import loads_limited
from engine.run.prompts_file import MAX_FILE_BYTES, MAX_NEW_TOKENS, MAX_REQUESTS, request_file_lines

MAX_N = 128  # serve's own bound on OpenAI's n (colibri/serve/protocol.py)
MAX_AT_SECONDS = 86400.0  # a day: a later arrival is a typo, not a trace (the replay would wait for it)
MAX_PROMPT_IDS = 1 << 20  # ids in one prompt_ids list; ctx_size refuses far fewer at replay
MAX_TOKEN_ID = (1 << 31) - 1  # the model's vocabulary is checked at tokenize time, naming the line
LINE_MAX_DEPTH = 4  # an object holding a list: 2 levels
KEYS = ("at", "prompt", "prompt_ids", "max_tokens", "n")


@dataclass(frozen=True)
class TraceLine:
    """One request as the file gives it (checked, not yet tokenized)."""

    line: int
    at: float
    max_tokens: int
    n: int = 1
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, tokenized: what the replay submits at `at` seconds."""

    at: float
    prompt_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1
    line: int = 0  # its line in the file (0: made in code)

    @property
    def tokens(self) -> int:
        """Context one of its sequences needs: the prompt and every token it generates."""
        return len(self.prompt_ids) + self.max_tokens


def read_trace(path: str | Path) -> list[TraceLine]:
    """Every request of the file, checked (module docstring), in file order."""
    where = f"--trace {path}"
    lines = request_file_lines(path, where, "request trace", "request")
    if len(lines) > MAX_REQUESTS:
        raise PromptError(f"{where}:{lines[MAX_REQUESTS][0]}: more than {MAX_REQUESTS} requests")
    out: list[TraceLine] = []
    for number, raw in lines:
        at = f"{where}:{number}"
        obj = loads_limited(raw, at, max_bytes=MAX_FILE_BYTES, max_depth=LINE_MAX_DEPTH, error=PromptError,
                            unique_keys=True, finite=True)
        req = _request(at, number, obj)
        if out and req.at < out[-1].at:
            raise PromptError(f"{at}: \"at\" {req.at:g} is before the line before's {out[-1].at:g} "
                              f"(requests must be in arrival order)")
        out.append(req)
    return out


def _request(at: str, number: int, obj) -> TraceLine:
    if not isinstance(obj, dict):
        raise PromptError(f"{at}: expected an object {{\"at\": ..., \"prompt_ids\" or \"prompt\": ..., "
                          f"\"max_tokens\": ...}}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise PromptError(f"{at}: unknown key {json.dumps(unknown[0])[:80]} (keys: {', '.join(KEYS)})")
    t = obj.get("at")
    if not _number(t) or not 0 <= t <= MAX_AT_SECONDS:
        raise PromptError(f"{at}: \"at\" must be seconds in [0, {MAX_AT_SECONDS:g}], got {_show(t)}")
    n_tokens = obj.get("max_tokens")
    if not _int(n_tokens) or not 1 <= n_tokens <= MAX_NEW_TOKENS:
        raise PromptError(f"{at}: \"max_tokens\" must be an integer in [1, {MAX_NEW_TOKENS}], got {_show(n_tokens)}")
    n = obj.get("n", 1)
    if not _int(n) or not 1 <= n <= MAX_N:
        raise PromptError(f"{at}: \"n\" must be an integer in [1, {MAX_N}], got {_show(n)}")
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    if has_text == has_ids:
        raise PromptError(f"{at}: give exactly one of \"prompt\" (text) and \"prompt_ids\" (token ids)")
    if has_text:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"{at}: \"prompt\" must be a non-empty string")
        return TraceLine(number, float(t), n_tokens, n, prompt=prompt)
    ids = obj["prompt_ids"]
    if not isinstance(ids, list) or not ids:
        raise PromptError(f"{at}: \"prompt_ids\" must be a non-empty list of token ids")
    if len(ids) > MAX_PROMPT_IDS:
        raise PromptError(f"{at}: \"prompt_ids\" holds {len(ids)} ids, at most {MAX_PROMPT_IDS}")
    bad = next((i for i, v in enumerate(ids) if not _int(v) or not 0 <= v <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise PromptError(f"{at}: \"prompt_ids\"[{bad}] must be a token id (an integer >= 0), got {_show(ids[bad])}")
    return TraceLine(number, float(t), n_tokens, n, prompt_ids=tuple(ids))


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v) -> str:
    """A value in an error line: short, as JSON."""
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:40] + "..."


def tokenize_trace(lines: list[TraceLine], tokenizer, vocab: int, path: str | Path = "") -> list[TraceRequest]:
    """The trace's requests with prompt ids: text through `tokenizer` (None: the model has none, and
    a text prompt is refused naming its line), every id checked against the vocabulary."""
    where = f"--trace {path}"
    out = []
    for r in lines:
        at = f"{where}:{r.line}"
        if r.prompt is not None:
            if tokenizer is None:
                raise PromptError(f"{at}: a text \"prompt\" needs the model's tokenizer.json, which it has not "
                                  f"(give \"prompt_ids\")")
            ids = tuple(tokenizer.encode(r.prompt).ids)
            if not ids:
                raise PromptError(f"{at}: \"prompt\" tokenizes to nothing")
        else:
            ids = r.prompt_ids
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise PromptError(f"{at}: token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
        out.append(TraceRequest(r.at, ids, r.max_tokens, r.n, r.line))
    return out


def load_trace(path: str | Path, tokenizer, vocab: int) -> list[TraceRequest]:
    """read_trace then tokenize_trace: the trace a replay runs."""
    return tokenize_trace(read_trace(path), tokenizer, vocab, path)


def check_context(requests: list[TraceRequest], ctx_size: int, path: str | Path = "") -> None:
    """Every request fits one sequence's context (its prompt and max_tokens), else one error naming its line."""
    for r in requests:
        if r.tokens > ctx_size:
            raise PromptError(f"--trace {path}:{r.line}: the request needs {r.tokens} tokens ({len(r.prompt_ids)} "
                              f"of prompt + {r.max_tokens} new), more than --ctx-size {ctx_size}")


def trace_digest(requests: list[TraceRequest]) -> str:
    """'sha256:<16 hex>' of the arrivals, ids, lengths and n: the same trace gives the same digest, and
    the prompts cannot be read back from it."""
    basis = json.dumps([[r.at, list(r.prompt_ids), r.max_tokens, r.n] for r in requests], separators=(",", ":"))
    return "sha256:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def save_trace(requests: list[TraceRequest], path: str | Path) -> Path:
    """The tokenized trace as a trace file of prompt_ids (atomic): what a tune's trials replay, so
    every trial runs the same tokens even if the user's file changes."""
    text = "".join(json.dumps({"at": r.at, "prompt_ids": list(r.prompt_ids), "max_tokens": r.max_tokens,
                               **({"n": r.n} if r.n != 1 else {})}) + "\n" for r in requests)
    atomic_write_text(path, text)
    return Path(path)
