"""A user's workload: the prompts a bench (and so every tune trial) runs instead of the fixed one.

    requests = load_workload("prompts.txt", tokenizer, default_max_new_tokens=32)

A prompts file is either one prompt per line (each decoded for `default_max_new_tokens`), or
JSON Lines of {"prompt": "...", "max_new_tokens": N} (max_new_tokens optional); a file whose
first non-blank line starts with `{` is read as JSON Lines. Blank lines are skipped; a line of a
plain file keeps its text as is (escape nothing). The file is untrusted: a regular file, at
most MAX_FILE_BYTES, UTF-8, at most MAX_REQUESTS requests, every prompt non-empty once
tokenized; the first violation is one PromptError naming the file and line.

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


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt's token ids and how many tokens it decodes."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def tokens(self) -> int:
        """Context the request needs: its prompt and every token it generates."""
        return len(self.prompt_ids) + self.max_new_tokens


def read_prompts(path: str | Path, default_max_new_tokens: int) -> list[tuple[str, int]]:
    """(prompt text, max_new_tokens) of every request in the file, in order."""
    where = f"--prompts {path}"
    text = read_text_input(path, "prompts file", PromptError, limit=MAX_FILE_BYTES)
    lines = split_lines(text)
    if not lines:
        raise PromptError(f"{where}: no prompt in the file")
    if len(lines) > MAX_REQUESTS:
        raise PromptError(f"{where}: {len(lines)} prompts, at most {MAX_REQUESTS}")
    if lines[0][1].lstrip().startswith("{"):
        objs = json_lines(lines, where, error=PromptError, max_bytes=MAX_FILE_BYTES)
        return [_json_request(f"{where} line {i}", obj, default_max_new_tokens) for (i, _), obj in zip(lines, objs)]
    return [(line, default_max_new_tokens) for _, line in lines]


def _json_request(at: str, obj, default_max_new_tokens: int) -> tuple[str, int]:
    if not isinstance(obj, dict):
        raise PromptError(f"{at}: expected an object {{\"prompt\": ..., \"max_new_tokens\": ...}}")
    unknown = sorted(set(obj) - {"prompt", "max_new_tokens"})
    if unknown:
        raise PromptError(f"{at}: unknown key {unknown[0]!r} (keys: prompt, max_new_tokens)")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptError(f"{at}: \"prompt\" must be a non-empty string")
    n = obj.get("max_new_tokens", default_max_new_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
        raise PromptError(f"{at}: \"max_new_tokens\" must be an integer in [1, {MAX_NEW_TOKENS}], got {n!r}")
    return prompt, n


def load_workload(path: str | Path, tokenizer, default_max_new_tokens: int) -> list[Request]:
    """The file's requests, tokenized with the model's tokenizer (None: the model has none)."""
    if tokenizer is None:
        raise PromptError(f"--prompts {path}: the model has no tokenizer.json to tokenize the prompts with")
    out = []
    for i, (prompt, n) in enumerate(read_prompts(path, default_max_new_tokens), 1):
        ids = tuple(tokenizer.encode(prompt).ids)
        if not ids:
            raise PromptError(f"--prompts {path}: prompt {i} tokenizes to nothing")
        out.append(Request(ids, n))
    return out


def workload_digest(requests: list[Request]) -> str:
    """'sha256:<16 hex>' of the token ids and output lengths: the same prompts give the same
    digest, and the text cannot be read back from it."""
    basis = json.dumps([[list(r.prompt_ids), r.max_new_tokens] for r in requests], separators=(",", ":"))
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
    text = "".join(json.dumps({"prompt_ids": list(r.prompt_ids), "max_new_tokens": r.max_new_tokens}) + "\n"
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
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
                and isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_NEW_TOKENS):
            raise PromptError(f"{where} line {i}: prompt_ids must be a non-empty list of token ids and "
                              f"max_new_tokens an integer in [1, {MAX_NEW_TOKENS}]")
        out.append(Request(tuple(ids), n))
    if not out:
        raise PromptError(f"{where}: no request in the file")
    return out
