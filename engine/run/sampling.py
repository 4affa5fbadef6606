"""Choosing the next token: the logits-processor hook, penalties and bias, the sampler, log-probs.

One step of `generate` (engine/run/generate.py), on the fp32 logits [V] of the last position:

    raw logits ──> log-probs reported to the client (log_softmax of the raw logits: the model's
       │           own distribution, before any penalty, bias, mask or temperature; vLLM's
       │           default "raw_logprobs", and what a client scoring text wants)
       ├─> Penalties (the Sampler's presence / frequency / repetition penalties and logit_bias)
       ├─> each LogitsProcessor the caller gave, in order (a grammar's token mask)
       └─> Sampler.pick: argmax when temperature == 0, else temperature, min_p, top_p, a draw

then every processor's accept(token); generation stops when one says done().
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from engine.base.errors import PromptError

TOP_LOGPROBS_MAX = 20  # OpenAI's limit for top_logprobs; a topk over the vocabulary per token
PENALTY_MAX = 2.0      # presence / frequency penalties, as OpenAI documents them: [-2, 2]
BIAS_MAX = 100.0       # logit_bias values, as OpenAI documents them: [-100, 100]
REPETITION_MAX = 10.0  # repetition_penalty in (0, 10]: 1 is off, ~1.1-1.3 is what people use


@runtime_checkable
class LogitsProcessor(Protocol):
    """A per-generation filter of the next token's logits (e.g. a grammar's token mask).

    __call__ gets the step's fp32 logits [V] (after the sampler's penalties and bias, and after
    the processors before it) and the ids generated so far; it returns logits [V] (in place or
    new); -inf bans a token. accept(token) is called with the token chosen, after the step.
    done() True after an accept ends the generation there (a grammar that is complete)."""

    def __call__(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor: ...

    def accept(self, token: int) -> None: ...

    def done(self) -> bool: ...


class Penalties:
    """The Sampler's presence / frequency / repetition penalties and logit_bias as a processor.

    presence and frequency count the generated tokens only (as OpenAI and vLLM do): a token seen
    n times loses presence + n * frequency. repetition_penalty (CTRL / transformers / vLLM) covers
    the prompt too: a positive logit of a token seen anywhere is divided by it, a negative one
    multiplied. The counts are kept incrementally (accept), not recounted each step."""

    def __init__(self, sampler: "Sampler", prompt_ids: list[int], vocab: int):
        self.s = sampler
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        if sampler.repetition_penalty != 1.0:
            self.seen[torch.as_tensor(prompt_ids, dtype=torch.long)] = True
        self.bias = None
        if sampler.logit_bias:
            ids = torch.as_tensor(list(sampler.logit_bias), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise PromptError(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})")
            self.bias = torch.zeros(vocab, dtype=torch.float32)
            self.bias[ids] = torch.tensor(list(sampler.logit_bias.values()), dtype=torch.float32)

    def __call__(self, logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        s = self.s
        out = logits.clone()
        if s.repetition_penalty != 1.0:
            hit = out[self.seen]
            out[self.seen] = torch.where(hit > 0, hit / s.repetition_penalty, hit * s.repetition_penalty)
        if s.frequency_penalty:
            out -= s.frequency_penalty * self.counts
        if s.presence_penalty:
            out -= s.presence_penalty * (self.counts > 0).float()
        if self.bias is not None:
            out += self.bias
        return out

    def accept(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True

    def done(self) -> bool:
        return False


@dataclass
class Sampler:
    """Greedy when temperature == 0; otherwise seeded temperature sampling, after min_p (drop
    tokens below min_p times the top token's probability) and top_p (nucleus). Penalties and
    logit_bias apply in both cases (they change the argmax too, as OpenAI's do)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.temperature < 0:
            raise PromptError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PromptError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise PromptError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_MAX <= getattr(self, name) <= PENALTY_MAX:
                raise PromptError(f"{name} must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= REPETITION_MAX:
            raise PromptError(f"repetition_penalty must be in (0, {REPETITION_MAX:g}], got {self.repetition_penalty}")
        if any(not -BIAS_MAX <= v <= BIAS_MAX for v in self.logit_bias.values()):
            raise PromptError(f"logit_bias values must be in [-{BIAS_MAX:g}, {BIAS_MAX:g}]")
        self._gen = torch.Generator().manual_seed(self.seed)

    def processors(self, prompt_ids: list[int], vocab: int) -> list[LogitsProcessor]:
        """The penalties and bias of this sampler for one generation (none when all are off, so
        plain sampling costs nothing more)."""
        if (self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias):
            return [Penalties(self, prompt_ids, vocab)]
        return []

    def __call__(self, logits: torch.Tensor) -> int:
        return self.pick(logits)

    def pick(self, logits: torch.Tensor) -> int:
        # logits: [V] fp32, after penalties and processors
        if self.temperature == 0:
            return int(torch.argmax(logits))
        return self.draw(self.probs(logits))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The weights `pick` draws from (temperature > 0): softmax(logits / temperature), then
        min_p, then top_p (not renormalised after top_p: a draw does not need it, and plain sampling
        draws from exactly these numbers as it always has; divide by the sum for probabilities). Speculative decoding's rejection sampling
        (engine/run/speculative.py) takes it as the target distribution, so a drafted token is
        accepted or replaced under exactly what plain sampling would have drawn from."""
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.min_p > 0:
            probs = torch.where(probs >= self.min_p * probs.max(), probs, torch.zeros_like(probs))
            probs = probs / probs.sum()  # so top_p below measures the mass min_p kept
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return probs

    def draw(self, probs: torch.Tensor) -> int:
        """One token from probs [V] (non-negative, not necessarily normalised), with this
        sampler's seeded generator."""
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def uniform(self) -> float:
        """One uniform draw in [0, 1) from this sampler's seeded generator (a rejection test)."""
        return float(torch.rand((), generator=self._gen))


def all_finite(logits: torch.Tensor) -> bool:
    """Whether every logit is finite, by one sum: it is finite only where every entry is (a NaN or an
    infinity carries through a sum; +inf and -inf make NaN), and it makes no temporary: 2 us at 4k
    entries and 10 us at 151k, where isfinite().all() took 14 and 179 (5% of a small model's resident
    decode step). A sum that overflows is checked entry by entry."""
    return math.isfinite(float(logits.sum())) or bool(torch.isfinite(logits).all())


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model, and the `top` most likely tokens
    of that step as (id, logprob), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """From the step's raw logits [V]: the model's own softmax (fp32 log_softmax)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        best = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), best)
