"""Drafters for speculative decoding (engine/run/speculative.py): who guesses the next tokens.

A drafter proposes up to k tokens that follow the sequence so far (prompt + accepted output); the
verify pass checks them all in one forward, so a guess costs a row of that pass, never a wrong
token. Each proposal names its `source`, the bucket the gate keeps its acceptance rate under
(a 1-token n-gram match is weaker evidence than a 4-token one).

    PromptLookup   the longest recent n-gram match (prompt lookup decoding): the last n tokens
                   of the sequence, found earlier in the prompt or output, propose what followed
                   them there. No model, every architecture; agents copy much of their context.
    MTP            the checkpoint's own multi-token-prediction layer (deepseek_v3, glm4_moe,
                   glm_moe_dsa): engine/run/mtp_drafter.py
    AutoDrafter    lookup where the text repeats, else the MTP layer

A drafter offers first (how many tokens, of which bucket: what the gate decides on), then proposes
the k the gate chose: the MTP layer computes only those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 4  # longest suffix looked up; longer matches add little over 4 tokens of context
MIN_NGRAM = 1  # a single-token match proposes too, under its own acceptance bucket


@dataclass
class Draft:
    """Up to k proposed tokens, and the acceptance bucket they count under."""

    tokens: list[int] = field(default_factory=list)
    source: str = ""


class PromptLookup:
    """Prompt lookup over one sequence: the longest suffix n-gram (MAX_NGRAM down to MIN_NGRAM)
    with an earlier occurrence proposes the tokens that followed it: at the most recent occurrence
    that has k tokens after it, else at the most recent one.

    Why not simply the most recent: while output copies its context, the suffix's most recent
    occurrence is often a few tokens back in the output itself (code repeats its short n-grams),
    where the sequence ends after one or two tokens; the copy's source, further back, has the k.
    On the trained reference's copy workload the most recent occurrence drafted 2.1 tokens a step
    at depth 8 (2.8 tokens emitted a step), this 7.3 (6.7).

    The index is built incrementally: per n, the starts of every n-gram's occurrences except the
    sequence's own suffix (whose continuation is not known yet), latest last. A proposal looks at
    most k + 1 occurrences per n back from the latest (only occurrences within the last k
    positions lack k tokens after them), whatever the length of the sequence."""

    name = "lookup"

    def __init__(self, seq: list[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.seq = seq  # the caller's list, grown by it: prompt + accepted tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._starts: list[dict[tuple, list[int]]] = [{} for _ in range(max_ngram + 1)]  # per n: n-gram → starts
        self._indexed = 0  # sequence length the index covers
        self._offered = Draft()

    def _index(self) -> None:
        seq = self.seq
        for length in range(self._indexed + 1, len(seq) + 1):
            # Sequence of `length`: the n-gram ending just before its last token stops being the suffix.
            for n in range(self.min_ngram, self.max_ngram + 1):
                start = length - 1 - n
                if start >= 0:
                    self._starts[n].setdefault(tuple(seq[start:start + n]), []).append(start)
        self._indexed = len(seq)

    def offer(self, k: int) -> tuple[int, str]:
        """(tokens it can propose, up to k; their acceptance bucket): the lookup itself, kept for propose."""
        self._offered = self._lookup(k)
        return len(self._offered.tokens), self._offered.source

    def propose(self, k: int) -> Draft:
        """The first k tokens of what offer found (the gate chose k)."""
        d = self._offered
        return Draft(d.tokens[:k], d.source)

    def _lookup(self, k: int) -> Draft:
        if k <= 0:
            return Draft()
        self._index()
        seq, L = self.seq, len(self.seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            starts = self._starts[n].get(tuple(seq[L - n:]))
            if not starts:
                continue
            start = starts[-1]  # the most recent, unless one a little further back has all k after it
            for earlier in reversed(starts[-(k + 1):]):
                if earlier + n + k <= L:
                    start = earlier
                    break
            follow = seq[start + n:start + n + k]
            if follow:
                return Draft(follow, f"lookup-{n}")
        return Draft()

    def accepted(self) -> None:
        """Told after each step (the sequence has grown); the index catches up on the next offer."""


class AutoDrafter:
    """Prompt lookup where the text repeats (a match of at least two tokens), else the MTP layer
    where the checkpoint has one, else a single-token lookup match."""

    name = "auto"

    def __init__(self, lookup: PromptLookup, mtp=None):
        self.lookup, self.mtp = lookup, mtp
        self._chosen = lookup

    def offer(self, k: int) -> tuple[int, str]:
        n, source = self.lookup.offer(k)
        self._chosen = self.lookup
        if self.mtp is not None and (n == 0 or source == "lookup-1"):
            m, mtp_source = self.mtp.offer(k)
            if m:
                self._chosen = self.mtp
                return m, mtp_source
        return n, source

    def propose(self, k: int) -> Draft:
        return self._chosen.propose(k)

    def accepted(self) -> None:
        self.lookup.accepted()
