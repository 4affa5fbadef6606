"""Prompt handling, sampling and the generate loop (prefill, then one token at a time)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.base.errors import ModelFormatError, PromptError
from engine.base.inputs import read_text_input
# The sampler and the logits-processor hook live in sampling.py; named here too, where callers
# of generate have always imported the Sampler from.
from engine.run.sampling import LogitsProcessor, Sampler, TokenLogprob, all_finite, token_logprob
from engine.run.speculative import Steps


def check_finite_logits(logits: torch.Tensor, where: str = "") -> None:
    """A NaN or infinite logit means a weight or scale is not a number (a corrupt checkpoint the
    load-time sample missed): argmax of NaNs is token 0, so the run would emit token 0 forever
    with exit 0. One sum over the vocabulary per token (sampling.all_finite)."""
    if not all_finite(logits):
        bad = "NaN" if bool(torch.isnan(logits).any()) else "infinite"
        raise ModelFormatError(f"the model produced {bad} logits{where}: a weight or scale of the checkpoint "
                               "is not a finite number (`colibri quality` checks every FP8 value)")


@dataclass
class Generation:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    token_seconds: list[float] = field(default_factory=list)  # each decode step after the first token
    cached_tokens: int = 0  # prompt tokens whose K/V was reused, not computed (engine/run/prefix_cache.py)
    # One per output id when generate(logprobs=k) was asked (k top entries each); else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stopped_by_processor: bool = False  # a processor's done() ended it


class Decoding:
    """One sequence's per-token logic, the same whether it runs alone (generate, below) or in a
    batch (engine/run/batch.py's scheduler): the prompt's checks, then for each step's fp32 logits
    [V] the sampler's penalties and bias, `processors` in order (e.g. engine/run/grammar.py's
    mask), the sampler's pick (`shape`, `step`), the token's log-probability and every processor's
    accept(token) (`record`); then whether the sequence is finished (`finished`: on_token, a
    processor's done(); `settle` adds max_new_tokens and a stop id).

    The caller owns the model calls, the KV cache and the timings (`gen`); `token` is the last
    token chosen, `position` where it goes into the cache at the next decode step."""

    def __init__(self, engine, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler | None = None,
                 stop_ids: set[int] | None = None, on_token=None, *, processors: Sequence[LogitsProcessor] = (),
                 logprobs: int | None = None, generation: Generation | None = None):
        self.sampler = sampler or Sampler()
        n = len(prompt_ids)
        if n == 0:
            raise PromptError("the prompt is empty")
        ctx = engine.kv.ctx_size
        if n + max_new_tokens > ctx:
            raise PromptError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds ctx_size {ctx}")
        vocab = engine.args.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        self.gen = generation if generation is not None else Generation(list(prompt_ids))
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens, self.stop_ids, self.on_token, self.logprobs = max_new_tokens, stop_ids, on_token, logprobs
        self.done = max_new_tokens <= 0  # nothing to generate: no processor is built, nothing runs
        self.token: int | None = None
        if self.done:
            return
        self.chain = [*self.sampler.processors(prompt_ids, vocab), *processors]
        self.where = f" for {engine.checkpoint.directory}" if hasattr(engine, "checkpoint") else ""

    @property
    def position(self) -> int:
        """The cache position of `token`, the input of the next decode step."""
        return len(self.prompt_ids) + len(self.gen.output_ids) - 1

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's raw logits [V] → the shaped logits [V] the sampler picks from."""
        check_finite_logits(logits, self.where)
        shaped = logits
        for p in self.chain:
            shaped = p(shaped, self.gen.output_ids)
        if self.chain and not bool(torch.isfinite(shaped).any()):  # a mask that allows nothing: no token to draw
            raise PromptError("the logits processors left no token allowed")
        return shaped

    def record(self, token: int, logits: torch.Tensor) -> None:
        """The token chosen, with its raw logits: its log-prob, the output, every processor told."""
        gen = self.gen
        if self.logprobs is not None:
            gen.logprobs.append(token_logprob(logits, token, self.logprobs))
        gen.output_ids.append(token)
        for p in self.chain:
            p.accept(token)
        self.token = token

    def step(self, logits: torch.Tensor) -> int:
        """The next token from this step's logits [V] (recorded)."""
        token = self.sampler.pick(self.shape(logits))
        self.record(token, logits)
        return token

    def finished(self, token: int) -> bool:
        """Whether on_token or a processor ends the sequence with `token`."""
        # on_token first: the token that completes a grammar is still the caller's text.
        stop = bool(self.on_token and self.on_token(token) is True)
        if self.chain and any(p.done() for p in self.chain):
            self.gen.stopped_by_processor = True
            return True
        return stop

    def settle(self, token: int) -> bool:
        """finished(token), or the length reached, or a stop id: whether the sequence ends (then `done`)."""
        self.done = (self.finished(token) or len(self.gen.output_ids) >= self.max_new_tokens
                     or bool(self.stop_ids and token in self.stop_ids))
        return self.done


def generate(engine, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler | None = None,
             stop_ids: set[int] | None = None, on_token=None, *, cached_tokens: int | None = None,
             processors: Sequence[LogitsProcessor] = (), logprobs: int | None = None,
             generation: Generation | None = None) -> Generation:
    """Prefill, then decode until max_new_tokens, a stop id, a processor's done(), or
    `on_token(token)` returning True (how a server stops at a stop sequence or when its client
    has gone).

    cached_tokens: how many of the prompt's first positions the caller has already put in the KV
    cache (`run --prompt-cache`); None: whatever the engine's prefix cache restores.
    Each step (engine/run/sampling.py): the sampler's penalties and bias, then `processors` in
    order (e.g. engine/run/grammar.py's mask), then the sampler's pick; then every processor's
    accept(token). `logprobs`: record each token's log-probability under the model (the raw
    logits' log_softmax) with that many top alternatives, in the Generation before on_token sees
    the token. `generation`: the record to fill (a caller's on_token can read it as it grows).
    The step is Decoding's (above), which the batch scheduler runs too (engine/run/batch.py)."""
    seq = Decoding(engine, prompt_ids, max_new_tokens, sampler, stop_ids, on_token, processors=processors,
                   logprobs=logprobs, generation=generation)
    gen = seq.gen
    if seq.done:
        return gen
    n = len(prompt_ids)
    t0 = time.perf_counter()
    # Only the suffix after a reused prefix is prefilled (none when the engine's prefix cache is off).
    reused = engine.restore_prefix(prompt_ids) if cached_tokens is None else min(cached_tokens, n - 1)
    gen.cached_tokens = reused
    logits = engine.forward(prompt_ids[reused:], reused, last_only=True)
    gen.prefill_seconds = time.perf_counter() - t0
    token = seq.step(logits[-1])
    gen.ttft_seconds = time.perf_counter() - t0
    speculator = getattr(engine, "speculator", None)
    if not seq.finished(token):
        if speculator is not None:  # drafts verified in one pass (engine/run/speculative.py)
            speculator.decode(Steps(seq.sampler, seq.shape, seq.record, seq.finished, max_new_tokens, stop_ids,
                                    unshaped=not seq.chain), gen, token, n)
        else:
            pos = n
            while len(gen.output_ids) < max_new_tokens and not (stop_ids and token in stop_ids):
                t = time.perf_counter()
                logits = engine.forward([token], pos)
                token = seq.step(logits[-1])
                gen.token_seconds.append(time.perf_counter() - t)
                pos += 1
                if seq.finished(token):
                    break
    engine.remember_prefix()  # the prompt and the answer so far: a next turn resends both
    return gen


def load_tokenizer(model_dir: str | Path):
    path = Path(model_dir) / "tokenizer.json"
    if not os.path.lexists(path):
        return None
    # Read through the bounded reader (a FIFO or a 20 GB file named tokenizer.json is one line),
    # then parsed from the text: Tokenizer.from_file would open whatever the path is.
    text = read_text_input(path, "tokenizer.json", PromptError)
    from tokenizers import Tokenizer
    try:
        return CheckedTokenizer(Tokenizer.from_str(text), path)
    except BaseException as exc:
        if not _is_tokenizer_failure(exc):
            raise
        raise PromptError(f"{path}: cannot load tokenizer ({_one_line(exc)})") from None


def _is_tokenizer_failure(exc: BaseException) -> bool:
    # The tokenizers library raises its own exception types, and turns a Rust panic (which a
    # malformed tokenizer.json can cause in encode) into pyo3's PanicException, a BaseException.
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


class CheckedTokenizer:
    """A tokenizers.Tokenizer whose failures in encode/decode are one-line PromptErrors."""

    def __init__(self, tokenizer, path: Path):
        self._tokenizer, self._path = tokenizer, path

    def _call(self, method: str, *args, **kwargs):
        try:
            return getattr(self._tokenizer, method)(*args, **kwargs)
        except BaseException as exc:
            if not _is_tokenizer_failure(exc):
                raise
            raise PromptError(f"{self._path}: the tokenizer failed in {method} ({_one_line(exc)})") from None

    def encode(self, *args, **kwargs):
        return self._call("encode", *args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._call("decode", *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise PromptError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise PromptError("--prompt-ids is empty")
    return ids


def random_prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    if n <= 0:
        raise PromptError(f"--prompt-tokens must be positive, got {n}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
