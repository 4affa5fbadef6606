"""draft_decode.py's prompt workloads (a helper of draft_decode.py, not a command; its docstring has
the method): copy, edit, code and free, PROMPTS prompts each, tokenized with the model's
tokenizer.json (else seeded ids), cut to fit the context beside the tokens decoded.

`workload_prompts(a, engine)` is what each child asks for (draft_child.py): the same prompts for every
mode of a workload, so each row and its `off` baseline decode after the same tokens.
"""

from __future__ import annotations

import collections
import keyword
import re

PROMPTS = 3  # prompts per workload and mode


def _copy_prompts(tokenizer, vocab: int, n: int, seed: int, edit: bool = False) -> list[list[int]]:
    """copy (the file again, unchanged) or edit (again with its most frequent identifier renamed)."""
    from engine.api import stdlib_corpus
    train, _held, _ = stdlib_corpus()
    files = [f for f in train.split("\n\n\n") if 400 < len(f) < 4000]
    out = []
    for i in range(n):
        text = files[(seed * 7919 + i * 104729) % len(files)][:1200]
        ask, again = "unchanged", text
        if edit:
            old = _most_frequent_identifier(text)
            new = f"{old}_v2"
            ask, again = f"with `{old}` renamed to `{new}`", re.sub(rf"\b{re.escape(old)}\b", new, text)
        head = "\n".join(again.splitlines()[:3])
        prompt = f"{text}\n# The same code again, {ask}:\n{head}\n"
        ids = tokenizer.encode(prompt).ids if tokenizer is not None else [b % vocab for b in prompt.encode()]
        out.append(ids)
    return out


def _most_frequent_identifier(text: str) -> str:
    """The identifier used most as code in text (followed by one of ( . = [ , : ) outside comment
    lines, so not a word of prose; not a keyword, self or cls; 3 characters or more); ties: first seen."""
    skip = set(keyword.kwlist) | {"self", "cls"}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    names = [w for w in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]{2,})\s*[(.=\[,:)]", code) if w not in skip]
    counts = collections.Counter(names)
    return max(counts, key=lambda w: (counts[w], -names.index(w))) if names else "x"


def _code_prompts(tokenizer, vocab: int, n: int, seed: int) -> list[list[int]]:
    """A piece of a held-out standard-library file to continue (a trained reference never saw it)."""
    from engine.api import stdlib_corpus
    _train, held, _ = stdlib_corpus()
    files = [f for f in held.split("\n\n\n") if 400 < len(f) < 4000]
    texts = [files[(seed * 7919 + i * 104729) % len(files)][:1200] for i in range(n)]
    return [tokenizer.encode(t).ids if tokenizer is not None else [b % vocab for b in t.encode()] for t in texts]


def _free_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    from engine.api import random_prompt_ids
    return [random_prompt_ids(64, vocab, seed * 100 + i) for i in range(n)]


def workload_prompts(a, engine) -> list[list[int]]:
    """The PROMPTS prompts of a.workload for this engine's vocabulary, each cut to its last
    ctx - tokens - 8 ids (room for the tokens decoded)."""
    from engine.api import load_tokenizer
    vocab = engine.args.vocab_size
    if a.workload in ("copy", "edit"):
        prompts = _copy_prompts(load_tokenizer(a.model), vocab, PROMPTS, a.seed, edit=a.workload == "edit")
    elif a.workload == "code":
        prompts = _code_prompts(load_tokenizer(a.model), vocab, PROMPTS, a.seed)
    else:
        prompts = _free_prompts(vocab, PROMPTS, a.seed)
    return [p[-(a.ctx - a.tokens - 8):] for p in prompts]

