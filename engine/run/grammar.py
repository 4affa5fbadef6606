"""Structured output: a grammar's token mask applied to the logits before each sample.

A request's JSON schema (or "any JSON object") is compiled into a grammar by llguidance, and a
`GrammarProcessor` masks every token the grammar cannot take next with -inf, is told the token the
sampler picked, and says when the grammar is complete. The generate loop (engine/run/generate.py)
runs it on every decoding path, since that loop is the only one. The sampler is unchanged: greedy
takes the argmax of the allowed tokens, temperature and top-p sample from their softmax.

Why llguidance (benchmarks/serving/grammar_overhead.py engines, 2026-12-06, this repository's
2-vCPU AMD EPYC box at load average 6-8 from other jobs, one torch thread; the synth BPE tokenizer
at 32,000 tokens (demo's) and 151,936; a 7-property schema with a nested object, enum, array,
anyOf, pattern and bounded strings; 3 walks of a valid 74-75-token document; medians):

    32k / 152k tokens    llguidance 1.9.1     xgrammar 0.2.9       outlines-core 0.2.14
    mask                 58 / 68 us           10 / 20 us           9 / 14 us
    unpack + -inf fill   49 / 168 us          41 / 246 us          48 / 242 us   (our code, the same)
    compile              7 / 1.2 ms           12 / 33 ms           3.8 s / 30 s
    wheel                abi3, no deps        torch, transformers, triton, pydantic, apache-tvm-ffi

- Per token, all three cost about the same once the mask is applied: unpacking the bitmask and
  filling -inf (the same numpy/torch code for each) is most of it at 152k, and xgrammar's ~50 us
  lead on the mask itself is noise against a MoE decode step (hundreds of ms on this box for demo
  resident, `grammar_overhead.py decode`: the whole mask measured 0.38 ms of a 0.5-1.3 s step).
- The compile is paid per request, since every request may bring its own schema: llguidance
  ~1-7 ms, xgrammar 12-33 ms, outlines-core seconds to half a minute (it builds a DFA index over
  the whole vocabulary): outlines-core is out for a server on that alone.
- The wheel: llguidance is one abi3 wheel with no Python dependencies. xgrammar 0.2.9 requires
  transformers (this project's engine never imports it), pydantic, apache-tvm-ffi and, on Linux
  x86_64, triton (a GPU compiler of hundreds of MB, useless on the CPU path).
- Unsupported schema keywords are errors that name the construct (`Unimplemented keys: ["not"]`,
  `oneOf constraints are not supported`, a regex's look-around), which the server passes on as 400.

The tokenizer side (`GrammarTokenizer`, llguidance's token trie) costs ~0.5 s at 32k tokens and
~1-2 s at 152k: built once per model, on the first structured request.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from engine.base.errors import PromptError

# Compact JSON (no free whitespace): with flexible whitespace a model may emit spaces or newlines
# forever inside a valid document and run to max_tokens; ", " and ": " are what json.dumps writes,
# the separators models have seen most.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


class GrammarError(PromptError):
    """A schema the grammar engine cannot compile, or a generation that left its grammar."""


def json_grammar(schema: dict | None = None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object), checked: a schema the engine
    cannot compile raises GrammarError with the engine's own words, which name the construct."""
    import llguidance
    if schema is None:
        schema = ANY_OBJECT
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                     "schema")


def json_lark(schema: dict) -> str:
    """A JSON schema as an item of a lark grammar (`%json {...}`), with the same options as
    json_grammar's (compact separators) carried in the schema's `x-guidance` key."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}})


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a lark text (llguidance's dialect: `%json`, special tokens as
    `<[id]>`, lazy lexemes), checked as json_grammar checks a schema."""
    import llguidance
    return _compiled(lambda: llguidance.LLMatcher.grammar_from_lark(text), "grammar")


def _compiled(make, what: str) -> str:
    """The grammar `make()` compiles, validated by llguidance; a failure of either is one
    GrammarError "cannot compile the <what>: ..." (json_grammar's schema, lark_grammar's text)."""
    import llguidance
    try:
        grammar = make()
    except ValueError as exc:
        raise GrammarError(f"cannot compile the {what}: {_one_line(exc)}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"cannot compile the {what}: {_one_line(messages[0] if messages else 'unknown error')}")
    return grammar


def _one_line(message) -> str:
    return " ".join(str(message).split())[:500]


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer (its token trie): built once per model."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        import llguidance
        # The tokenizer's own JSON: tokenizers.Tokenizer (or the engine's CheckedTokenizer) hands it over.
        text = tokenizer.to_str()
        n_vocab = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        eos = sorted(eos_ids) or None  # None: llguidance reads it from the tokenizer
        self.lltokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
        self.vocab_size = vocab_size

    def processor(self, grammar: str) -> GrammarProcessor:
        return GrammarProcessor(self, grammar)


class GrammarProcessor:
    """One generation's grammar state: the LogitsProcessor contract over an llguidance matcher."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        import llguidance
        self._matcher = llguidance.LLMatcher(tokenizer.lltokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"cannot compile the schema: {_one_line(self._matcher.get_error())}")
        words = (tokenizer.lltokenizer.vocab_size + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)  # reused: one bit per token, set = allowed
        self._vocab = tokenizer.vocab_size

    def __call__(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        # numpy unpacks 1 bit -> 1 byte in ~10 us at 152k; count pads the ids past the grammar's
        # vocabulary (a model's padded embedding rows) with 0: never allowed.
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=logits.shape[-1])
        if not allowed.any():  # every logit -inf: softmax would be NaN, argmax token 0
            raise GrammarError("the grammar allows no next token")
        return logits.masked_fill(torch.from_numpy(allowed == 0), float("-inf"))

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the grammar: {_one_line(self._matcher.get_error())}")

    def done(self) -> bool:
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar engine failed: {_one_line(self._matcher.get_error())}")
