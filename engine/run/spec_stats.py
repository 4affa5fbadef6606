"""Speculative decoding's numbers that outlive a step: the counters every run reports (SpecStats, and
the run JSON's flat figures of them), and the closed forms of the gate's model (engine/run/spec_gate.py)
that the cost model's `plan` predicts with too (tuner/costmodel/speculative.py): the tokens a draft of
some depth yields at an acceptance, the experts several tokens' routes read, the speed-up of drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters since reset (what run/bench/serve report)."""

    steps: int = 0  # decode steps (plain and verify) after the first token
    verify_steps: int = 0
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the steps produced (accepted drafts + one per step, less any cut by a stop)
    rows: int = 0  # verify rows computed (drafted + 1 per verify step)
    bytes_read: int = 0  # expert / layer bytes the store read during the steps
    mtp_loads: int = 0  # MTP layer loads after its memory was lent to the expert cache (engine/run/mtp_drafter.py)
    decisions: dict = field(default_factory=dict)  # why a step had the depth it had → count
    depths: dict = field(default_factory=dict)  # depth → steps

    def decide(self, depth: int, reason: str, steps: int = 1) -> None:
        if steps:
            self.decisions[reason] = self.decisions.get(reason, 0) + steps
            self.depths[depth] = self.depths.get(depth, 0) + steps

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "verify_steps": self.verify_steps, "drafted": self.drafted,
            "accepted": self.accepted, "emitted": self.emitted, "rows": self.rows,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_step": self.emitted / self.steps if self.steps else None,
            "bytes_per_token": self.bytes_read / self.emitted if self.emitted else None,
            "mtp_loads": self.mtp_loads,
            "decisions": dict(sorted(self.decisions.items())),
            "depths": {str(k): v for k, v in sorted(self.depths.items())},
        }


def draft_figures(stats: dict) -> dict:
    """The run JSON's flat figures of a SpecStats dict (engine/api/results.py prints them)."""
    if not stats:
        return {}
    return {"tokens_per_step": stats["tokens_per_step"], "draft_acceptance": stats["acceptance"],
            "drafted_tokens": stats["drafted"], "draft_bytes_per_token": stats["bytes_per_token"]}


def expected_tokens(depth: int, acceptance: float) -> float:
    """Tokens a step of `depth` drafts produces on average when each draft is accepted with
    probability `acceptance` given the ones before it were: 1 + a + ... + a^depth."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(depth + 1) if a >= 1.0 else (1.0 - a ** (depth + 1)) / (1.0 - a)


def independent_union(rows: int, experts: int, top_k: int) -> float:
    """Expected distinct experts `rows` tokens route to in one layer, in units of one token's
    top_k, when each token's choice is independent and uniform: E (1 - (1 - K/E)^n) / K."""
    if experts <= 0 or top_k <= 0:
        return 1.0
    share = min(top_k / experts, 1.0)
    return (1.0 - (1.0 - share) ** rows) / share


def draft_speedup(depth: int, acceptance: float, compute_s: float, stall_s: float, union: float,
                  row_cost: float = 1.0, draft_s: float = 0.0) -> float:
    """Tokens per second of steps drafting `depth` tokens over plain steps: E(depth) / C(depth + 1)
    times C(1) (engine/run/spec_gate.py's model; the cost model's `plan` predicts with it too). union: the
    expert bytes the depth + 1 rows read relative to one row's."""
    plain = compute_s + stall_s
    if plain <= 0:
        return 1.0
    cost = compute_s * (1.0 + row_cost * depth) + stall_s * union + depth * draft_s
    return expected_tokens(depth, acceptance) * plain / cost
