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

import numpy as np

MAX_NGRAM = 4  # longest suffix looked up; longer matches add little over 4 tokens of context
MIN_NGRAM = 1  # a single-token match proposes too, under its own acceptance bucket
FEW_CANDIDATES = 24  # earlier positions of the last token up to which a lookup extends them in Python
_BACK = np.arange(MAX_NGRAM)  # offsets back from a match's last token


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

    No index: the sequence is mirrored into an int32 array (the memory plan's LOOKUP_BYTES_PER_TOKEN,
    engine/movement/plan.py, with its growth room),
    and a lookup is a vectorised scan. The earlier positions holding the last token are found in one
    comparison; how far each match runs backwards (up to MAX_NGRAM) in MAX_NGRAM - 1 more over those
    candidates alone. An n-gram index of Python dicts took ~800 bytes a context token (25 MiB at a
    32k context, charged to the memory plan whatever the prompt); the scan reads 4 bytes a token
    (~2 us at 1k tokens, ~20 us at 32k, beside a decode step of a millisecond and more)."""

    name = "lookup"

    def __init__(self, seq: list[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.seq = seq  # the caller's list, grown by it: prompt + accepted tokens
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tokens = np.empty(max(64, len(seq)), dtype=np.int32)  # seq[:_mirrored], as int32
        self._mirrored = 0
        self._offered = Draft()

    def _mirror(self) -> np.ndarray:
        """The sequence as an int32 array (the caller's list may have grown since, or been cut back)."""
        seq, L = self.seq, len(self.seq)
        done = min(self._mirrored, L)
        if L > self._tokens.shape[0]:
            grown = np.empty(max(L, 2 * self._tokens.shape[0]), dtype=np.int32)
            grown[:done] = self._tokens[:done]
            self._tokens = grown
        if L > done:
            self._tokens[done:L] = seq[done:L]
        self._mirrored = L
        return self._tokens[:L]

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
        t = self._mirror()
        L = t.shape[0]
        if L < 2:
            return Draft()
        # Every earlier n-gram end e (e <= L - 2: a token follows it) that holds the last token ...
        ends = np.flatnonzero(t[:L - 1] == t[L - 1])
        if ends.shape[0] == 0:
            return Draft()
        # ... and how far back each match runs (the n of the longest suffix n-gram ending at e)
        depth = min(self.max_ngram, L - 1)
        if ends.shape[0] <= FEW_CANDIDATES:  # a handful: a loop over Python ints beats numpy's per-call cost
            seq = self.seq
            suffix = seq[L - depth:][::-1]
            at_list = ends.tolist()
            runs = []
            for e in at_list:
                n = 1
                while n < depth and e - n >= 0 and seq[e - n] == suffix[n]:
                    n += 1
                runs.append(n)
            n = max(runs)
            at = [e for e, r in zip(at_list, runs) if r == n]
        else:
            back = _BACK[:depth]  # [depth]
            pos = ends[:, None] - back  # [c, depth]: the tokens each match would need, backwards
            same = (t[np.maximum(pos, 0)] == t[L - 1 - back]) & (pos >= 0)
            run = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # [c]
            n = int(run.max())
            at = ends[run == n].tolist()
        if n < self.min_ngram:
            return Draft()
        # at: the occurrences of the longest suffix n-gram, by their last position, ascending. The most
        # recent, unless one a little further back has all k tokens after it.
        end = at[-1]
        for earlier in reversed(at[-(k + 1):]):
            if earlier + 1 + k <= L:
                end = earlier
                break
        return Draft(self.seq[end + 1:end + 1 + k], f"lookup-{n}")

    def accepted(self) -> None:
        """Told after each step (the sequence has grown); the mirror catches up on the next offer."""


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
