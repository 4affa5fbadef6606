"""A user's workload: the prompts a bench (and so every tune trial) runs instead of the fixed one.

    requests = load_workload("prompts.txt", tokenizer, default_max_new_tokens=32)

A prompts file is either one prompt per line (each decoded for `default_max_new_tokens`), or
JSON Lines of {"prompt": "...", "max_new_tokens": N} (max_new_tokens optional); a file whose
first non-blank line starts with `{` is read as JSON Lines. Blank lines are skipped; a line of a
plain file keeps its text as is (escape nothing). The file is untrusted: a regular file, at
most MAX_FILE_BYTES, UTF-8, at most MAX_REQUESTS requests, every prompt non-empty once
tokenized; the first violation is one PromptError naming the file and line.

Conversations: a JSON line may name its conversation, {"conversation": "c1", "prompt": ...}. The
lines of one conversation are its turns, in file order (conversations may interleave, as users
do), and each turn resends the history, as an OpenAI client does: its prompt begins with the
previous turn's prompt (the answer and the next message follow) and is longer. A bench runs the
requests in file order, so with the prefix cache on (EngineConfig.prefix_cache) a turn reuses the
KV of the history before it (engine/run/prefix_cache.py); `tune` searches that cache's share.

`workload_digest` names a workload without its text (a hash of the token ids and output
lengths), for the profile entry that records which workload a config was tuned for.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from engine.base.durable import atomic_write_text
from engine.base.errors import PromptError
from engine.base.inputs import read_text_input
from engine.base.jsonlimits import json_lines, split_lines

MAX_FILE_BYTES = 16 << 20
MAX_REQUESTS = 4096
MAX_NEW_TOKENS = 1 << 16


MAX_CONVERSATION_NAME = 256


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt's token ids and how many tokens it decodes; a turn of
    a conversation names it (its prompt then extends the conversation's previous turn's)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    conversation: str | None = None

    @property
    def tokens(self) -> int:
        """Context the request needs: its prompt and every token it generates."""
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(frozen=True)
class Turn:
    """One request of a prompts file as written: its text, output length, and conversation (or None)."""

    prompt: str
    max_new_tokens: int
    conversation: str | None = None


def read_prompts(path: str | Path, default_max_new_tokens: int) -> list[tuple[str, int]]:
    """(prompt text, max_new_tokens) of every request in the file, in order."""
    return [(t.prompt, t.max_new_tokens) for t in read_turns(path, default_max_new_tokens)]


def read_turns(path: str | Path, default_max_new_tokens: int) -> list[Turn]:
    """Every request of the file, in order, with its conversation (JSON Lines only)."""
    where = f"--prompts {path}"
    lines = request_file_lines(path, where, "prompts file", "prompt")
    if len(lines) > MAX_REQUESTS:
        raise PromptError(f"{where}: {len(lines)} prompts, at most {MAX_REQUESTS}")
    if not lines[0][1].lstrip().startswith("{"):
        return [Turn(line, default_max_new_tokens) for _, line in lines]
    objs = json_lines(lines, where, error=PromptError, max_bytes=MAX_FILE_BYTES)
    turns = [_json_request(f"{where} line {i}", obj, default_max_new_tokens) for (i, _), obj in zip(lines, objs)]
    _check_conversations(where, [i for i, _ in lines], turns)
    return turns


def request_file_lines(path: str | Path, where: str, what: str, noun: str) -> list[tuple[int, str]]:
    """The non-blank (number, line) pairs of a requests file (--prompts, request_trace.py's --trace):
    read as untrusted input of at most MAX_FILE_BYTES, or one PromptError when it holds no line."""
    lines = split_lines(read_text_input(path, what, PromptError, limit=MAX_FILE_BYTES))
    if not lines:
        raise PromptError(f"{where}: no {noun} in the file")
    return lines


def _json_request(at: str, obj, default_max_new_tokens: int) -> Turn:
    if not isinstance(obj, dict):
        raise PromptError(f"{at}: expected an object {{\"prompt\": ..., \"max_new_tokens\": ...}}")
    unknown = sorted(set(obj) - {"prompt", "max_new_tokens", "conversation"})
    if unknown:
        raise PromptError(f"{at}: unknown key {unknown[0]!r} (keys: prompt, max_new_tokens, conversation)")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptError(f"{at}: \"prompt\" must be a non-empty string")
    n = obj.get("max_new_tokens", default_max_new_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
        raise PromptError(f"{at}: \"max_new_tokens\" must be an integer in [1, {MAX_NEW_TOKENS}], got {n!r}")
    name = obj.get("conversation")
    if name is not None and not (isinstance(name, str) and name.strip() and len(name) <= MAX_CONVERSATION_NAME):
        raise PromptError(f"{at}: \"conversation\" must be a non-empty string of at most {MAX_CONVERSATION_NAME} "
                          f"characters, got {name!r:.80}")
    return Turn(prompt, n, name)


def _check_conversations(where: str, line_numbers: list[int], turns: list[Turn]) -> None:
    """Each turn of a conversation resends the history: it begins with the previous turn's prompt."""
    last: dict[str, tuple[int, int, str]] = {}  # conversation -> (its turns so far, line, prompt)
    for line, turn in zip(line_numbers, turns):
        if turn.conversation is None:
            continue
        count, before, prompt = last.get(turn.conversation, (0, 0, ""))
        if count and (not turn.prompt.startswith(prompt) or len(turn.prompt) == len(prompt)):
            raise PromptError(f"{where} line {line}: turn {count + 1} of conversation {turn.conversation!r} does not "
                              f"extend its turn {count} (line {before}): a turn's prompt begins with the previous "
                              "turn's and adds to it (the history is resent)")
        last[turn.conversation] = (count + 1, line, turn.prompt)


def load_workload(path: str | Path, tokenizer, default_max_new_tokens: int) -> list[Request]:
    """The file's requests, tokenized with the model's tokenizer (None: the model has none)."""
    if tokenizer is None:
        raise PromptError(f"--prompts {path}: the model has no tokenizer.json to tokenize the prompts with")
    out = []
    for i, turn in enumerate(read_turns(path, default_max_new_tokens), 1):
        ids = tuple(tokenizer.encode(turn.prompt).ids)
        if not ids:
            raise PromptError(f"--prompts {path}: prompt {i} tokenizes to nothing")
        out.append(Request(ids, turn.max_new_tokens, turn.conversation))
    return out


def conversation_reuse(requests: list[Request]) -> dict:
    """What a prefix cache can save a conversation workload: its conversations, and of its prompt
    tokens how many each turn shares with its conversation's previous turn (token for token: a
    tokenizer may merge across the turn's seam) and the longest conversation's last prompt."""
    previous: dict[str, tuple[int, ...]] = {}
    shared = 0
    for r in requests:
        if r.conversation is None:
            continue
        before = previous.get(r.conversation, ())
        n = min(len(before), len(r.prompt_ids))
        i = 0
        while i < n and before[i] == r.prompt_ids[i]:
            i += 1
        shared += i
        previous[r.conversation] = r.prompt_ids
    return {"conversations": len(previous), "shared_tokens": shared,
            "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "longest_history": max((len(ids) for ids in previous.values()), default=0)}


def workload_digest(requests: list[Request]) -> str:
    """'sha256:<16 hex>' of the token ids, output lengths and conversations: the same prompts give
    the same digest, and the text cannot be read back from it."""
    basis = json.dumps([[list(r.prompt_ids), r.max_new_tokens] + ([r.conversation] if r.conversation else [])
                        for r in requests], separators=(",", ":"))
    return "sha256:" + hashlib.sha256(basis.encode()).hexdigest()[:16]


def lengths(values: list[int]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "total": sum(values)}


def describe(requests: list[Request]) -> dict:
    """Lengths and digest of a workload (what a result or profile may record of it)."""
    return {"requests": len(requests), "prompt_tokens": lengths([len(r.prompt_ids) for r in requests]),
            "max_new_tokens": lengths([r.max_new_tokens for r in requests]), "sha256": workload_digest(requests)}


def save_requests(requests: list[Request], path: str | Path) -> Path:
    """The tokenized workload as JSON Lines of {prompt_ids, max_new_tokens} (atomic): what a
    tune's trials read, so every trial runs the same requests even if the user's file changes."""
    text = "".join(json.dumps({"prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens,
                               **({"conversation": r.conversation} if r.conversation else {})}) + "\n"
                   for r in requests)
    atomic_write_text(path, text)
    return Path(path)


def load_requests(path: str | Path) -> list[Request]:
    """A workload written by save_requests (bench --workload)."""
    where = f"--workload {path}"
    text = read_text_input(path, "workload file", PromptError, limit=MAX_FILE_BYTES * 4)
    lines = split_lines(text)
    out = []
    for (i, _), obj in zip(lines, json_lines(lines, where, error=PromptError, max_bytes=MAX_FILE_BYTES * 4)):
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
        n = obj.get("max_new_tokens") if isinstance(obj, dict) else None
        name = obj.get("conversation") if isinstance(obj, dict) else None
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                and isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_NEW_TOKENS
                and (name is None or (isinstance(name, str) and 0 < len(name) <= MAX_CONVERSATION_NAME))):
            raise PromptError(f"{where} line {i}: prompt_ids must be a non-empty list of token ids, "
                              f"max_new_tokens an integer in [1, {MAX_NEW_TOKENS}] and conversation, where "
                              f"given, a string of at most {MAX_CONVERSATION_NAME} characters")
        out.append(Request(tuple(ids), n, name))
    if not out:
        raise PromptError(f"{where}: no request in the file")
    return out
