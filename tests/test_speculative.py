"""Speculative decoding (engine/run/speculative.py, engine/run/drafters.py, engine/arch/kv_rollback.py).

The invariants (docs/DESIGN.md, "Reuse"): greedy output with drafts is the output without them,
on every architecture and in bf16 (the native decode kernels) as in fp32; sampling with drafts
keeps the target distribution (a chi-square test over seeded samples on a tiny vocabulary, with
penalties, top_p and a grammar-like mask shaping it); a verify's rejected rows leave the KV cache
as if never written, at every rejection point and for every cache kind (plain, MLA latents with
the DSA indexer, gpt-oss's sliding rings, int8 rows); the gate turns drafting off where its
modelled cost exceeds the saving; prompt lookup on text that repeats accepts nearly all drafts.
"""

from __future__ import annotations

import random
import types

import httpx

import pytest
import torch
from scipy.stats import chi2

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run import spec_gate, speculative
from engine.run.drafters import Draft, PromptLookup
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from engine.run.spec_gate import Gate
from engine.run.spec_stats import draft_speedup, expected_tokens, independent_union
from engine.run.speculative import Speculator
from colibri_hf_models import ARCHS, build
from colibri_tiny import make_tiny

CTX = 96
# Repeated n-grams whose continuations differ: lookup drafts, some right, some wrong.
PROMPT = [(7 * i + 3) % 200 for i in range(12)] * 2 + [5, 9, 3, 10, 17, 24]


def config(**kw):
    return EngineConfig(ctx_size=CTX, threads=1, **kw)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d)
    return request.param, d


# --- greedy: the same tokens, every architecture ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_tokens_identical_with_drafts(arch_dir, dtype):
    _, d = arch_dir
    with Engine(d, config(dtype=dtype)) as e:
        plain = generate(e, PROMPT, 24, Sampler()).output_ids
    with Engine(d, config(dtype=dtype, draft="fixed", draft_depth=5)) as e:
        drafted = generate(e, PROMPT, 24, Sampler()).output_ids
        stats = e.speculator.stats
    assert drafted == plain
    assert stats.drafted > 0 and stats.emitted == len(plain) - 1


# --- KV rollback at every rejection point -----------------------------------------------------------

ROLLBACK_CASES = {
    "qwen3_moe": {},                        # KVCache, the native decode routes in bf16
    "deepseek_v3": {},                      # MLA latents
    "glm_moe_dsa": {},                      # MLA latents + the DSA indexer keys
    "gpt_oss": {},                          # sliding rings of 8 slots
    "qwen3_moe-int8": {"kv_dtype": "int8"},  # quantized rows: codes and one scale per row
}


@pytest.mark.parametrize("case", sorted(ROLLBACK_CASES))
def test_rollback_after_rejection_at_every_position(case, tmp_path):
    """Verify the true continuation's first j tokens then wrong ones, roll back to j, decode on:
    every later logit is the one decoding without the verify gives, bit for bit."""
    arch = case.split("-")[0]
    build(arch, tmp_path)
    kw = dict(dtype="bf16", **ROLLBACK_CASES[case])
    n_after = 6
    prompt = PROMPT[:20]  # longer than gpt-oss's window of 8: its rings have wrapped
    with Engine(tmp_path, config(**kw)) as e:
        first = int(torch.argmax(e.forward(prompt, 0, last_only=True)[-1]))
        truth, logits, token = [], [], first
        for i in range(7 + n_after):
            row = e.forward([token], len(prompt) + i)[-1]
            truth.append(token)
            logits.append(row)
            token = int(torch.argmax(row))
    depth = 6  # 7 verify rows: within gpt-oss's ring of 8
    with Engine(tmp_path, config(**kw)) as e:
        if e.max_verify_rows is not None:
            assert e.max_verify_rows == 8
        for j in range(depth + 1):
            e.forward(prompt, 0, last_only=True)
            wrong = [(t + 1 + i) % e.args.vocab_size for i, t in enumerate(truth[j + 1:depth + 1])]
            rows = e.verify(truth[:j + 1] + wrong, len(prompt))
            for i in range(j + 1):
                assert torch.equal(rows[i], logits[i]), f"verify row {i}"
            e.rollback(len(prompt) + j + 1)
            assert len(e.kv_tokens) == len(prompt) + j + 1
            for i in range(j + 1, j + 1 + n_after):
                got = e.forward([truth[i]], len(prompt) + i)[-1]
                assert torch.equal(got, logits[i]), f"rejected after {j}: position {len(prompt) + i} differs"


def test_rollback_restores_ring_slots(tmp_path):
    build("gpt_oss", tmp_path)
    with Engine(tmp_path, config(dtype="fp32")) as e:
        e.forward(PROMPT[:20], 0, last_only=True)
        rings = [i for i, t in enumerate(e.kv.k) if t.shape[1] < e.kv.ctx_size]
        assert rings
        before = [e.kv.k[i].clone() for i in rings]
        e.verify([1, 2, 3, 4], 20)
        assert not all(torch.equal(e.kv.k[i], b) for i, b in zip(rings, before))
        e.rollback(20)
        assert all(torch.equal(e.kv.k[i], b) for i, b in zip(rings, before))


# --- sampling: the distribution is the target's ----------------------------------------------------

V = 4


class MarkovEngine:
    """A fake engine over V tokens: the logits of a position depend on the token fed there. Enough
    of the Engine for generate and the Speculator (verify rows are decode steps by construction)."""

    def __init__(self, policy="fixed", depth=2):
        torch.manual_seed(3)
        self.table = torch.randn(V, V) * 1.5  # fed token → next logits
        self.args = types.SimpleNamespace(vocab_size=V, num_experts=0, top_k=0, rope={}, max_position_embeddings=64)
        self.kv = types.SimpleNamespace(ctx_size=64)
        self.config = EngineConfig(draft=policy, draft_depth=depth)
        self.store, self.model, self.max_verify_rows = None, object(), None
        self.kv_tokens: list[int] = []
        self.speculator = Speculator(self)

    def restore_prefix(self, ids):
        return 0

    def remember_prefix(self):
        pass

    def forward(self, tokens, start, last_only=False):
        rows = self.table[torch.as_tensor(tokens)]
        return rows[-1:] if last_only else rows

    def verify(self, tokens, start):
        return self.forward(tokens, start)

    def rollback(self, length):
        pass


class FixedDrafter:
    """Proposes the cycle `tokens` from where the sequence's length puts it."""

    name = "fixed"

    def __init__(self, seq, tokens):
        self.seq, self.tokens = seq, tokens

    def offer(self, k):
        return k, "fixed"

    def propose(self, k):
        n = len(self.seq)
        return Draft([self.tokens[(n + i) % len(self.tokens)] for i in range(k)], "fixed")

    def accepted(self):
        pass


class BanToken:
    """A processor banning one token (a grammar's mask, for the test's purpose)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, logits, generated):
        out = logits.clone()
        out[self.token] = float("-inf")
        return out

    def accept(self, token):
        assert token != self.token

    def done(self):
        return False


def _sampler(seed):
    return Sampler(temperature=0.9, top_p=0.95, presence_penalty=0.7, seed=seed)


def _expected(engine, prompt, ban):
    """The exact joint distribution of the first four tokens plain sampling draws."""
    from engine.run.sampling import Penalties
    probs = {}
    s = _sampler(0)

    def dist(history, fed):
        pen = Penalties(s, prompt, V)
        for t in history:
            pen.accept(t)
        logits = pen(engine.table[fed], history)
        logits = BanToken(ban)(logits, history)
        p = s.probs(logits)
        return p / p.sum()

    p1 = dist([], prompt[-1])
    for a in range(V):
        p2 = dist([a], a)
        for b in range(V):
            p3 = dist([a, b], b)
            for c in range(V):
                p4 = dist([a, b, c], c)
                for e in range(V):
                    probs[(a, b, c, e)] = float(p1[a] * p2[b] * p3[c] * p4[e])
    return probs


@pytest.mark.parametrize("drafts", [[1, 2, 0], [3]])
def test_rejection_sampling_keeps_the_distribution(drafts):
    """Chi-square over the joint law of four sampled tokens (the last three from verify steps of
    up to two drafts): drafts right or wrong, a drafted token the mask bans (0), penalties and
    top_p shaping the target: the law is plain sampling's."""
    engine = MarkovEngine()
    engine.speculator.drafter_for = lambda seq: FixedDrafter(seq, drafts)
    prompt, ban = [1], 0
    want = _expected(engine, prompt, ban)
    n = 8000
    counts: dict = {}
    for seed in range(n):
        out = generate(engine, prompt, 4, _sampler(seed), processors=[BanToken(ban)]).output_ids
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert all(t[0] != ban for t in counts) and all(ban not in t for t in counts)
    stats = engine.speculator.stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    cells = [k for k, p in want.items() if p * n >= 5]
    rest = sum(want[k] for k in want if k not in cells)
    observed = [counts.get(k, 0) for k in cells] + [n - sum(counts.get(k, 0) for k in cells)]
    expected = [want[k] * n for k in cells] + [rest * n]
    stat = sum((o - x) ** 2 / x for o, x in zip(observed, expected) if x > 0)
    df = len([x for x in expected if x > 0]) - 1
    assert stat < chi2.ppf(0.999, df), f"chi-square {stat:.1f} on {df} degrees of freedom"


def test_greedy_drafted_token_the_mask_bans_is_rejected():
    engine = MarkovEngine()
    plain_engine = MarkovEngine(policy="off")
    plain_engine.speculator = None
    engine.speculator.drafter_for = lambda seq: FixedDrafter(seq, [0])
    want = generate(plain_engine, [1], 8, Sampler(), processors=[BanToken(0)]).output_ids
    got = generate(engine, [1], 8, Sampler(), processors=[BanToken(0)]).output_ids
    assert got == want and 0 not in got
    assert engine.speculator.stats.accepted == 0 and engine.speculator.stats.drafted > 0


# --- the gate ---------------------------------------------------------------------------------------

def test_expected_tokens_and_union():
    assert expected_tokens(0, 0.3) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)
    assert independent_union(1, 64, 8) == pytest.approx(1.0)
    assert independent_union(4, 64, 8) < 4.0 and independent_union(4, 8, 8) == pytest.approx(1.0)


def _gate(compute, stall, union_power=1.0, row_cost=1.0, experts=(64, 8)):
    gate = Gate("gate", 8, lambda n: independent_union(n, *experts), row_cost)
    for _ in range(3):
        gate.observe(1, compute + stall, stall, 1 << 20)
    gate.union_power.value = union_power
    return gate


def test_gate_turns_drafting_off_when_the_verify_costs_more_than_it_saves():
    # Resident: every verify row costs a plain step (row_cost 1): no depth can pay.
    gate = _gate(compute=0.01, stall=0.0)
    for _ in range(10):
        gate.observe_accept("lookup-2", 2, 2)
    assert gate.depth(4, "lookup-2", "lookup") == (0, "gated off")
    # Streaming, the reads dominating, rows sharing them: a well-accepted draft pays...
    gate = _gate(compute=0.002, stall=0.05, union_power=0.2, row_cost=0.2)
    for _ in range(10):
        gate.observe_accept("lookup-3", 3, 3)
    k, why = gate.depth(4, "lookup-3", "lookup")
    assert why == "drafted" and k == 4
    # ...but the same acceptance with the union of independent routing (each row's experts new
    # bytes) does not: the extra expert bytes exceed the saving.
    gate = _gate(compute=0.002, stall=0.05, union_power=1.0, row_cost=0.2)
    for _ in range(10):
        gate.observe_accept("lookup-3", 1, 3)
    assert gate.depth(4, "lookup-3", "lookup") == (0, "gated off")
    assert draft_speedup(4, 1 / 3, 0.002, 0.05, independent_union(5, 64, 8), 0.2) < 1.0


def test_gate_explores_rarely_once_off():
    """Gated off, EXPLORE_DEPTH drafts are tried again after 16, 32, 64... steps, and never before the
    trial's modelled cost is 3% of the plain steps' time, then 1.5%...: a verify that costs many plain
    steps is tried that much more rarely, and trials that keep losing ever more rarely."""
    assert spec_gate.EXPLORE_SHARE == 0.03 and spec_gate.EXPLORE_DEPTH == 2
    gate = _gate(compute=0.01, stall=0.0, row_cost=0.1)
    for _ in range(10):
        gate.observe_accept("lookup-1", 0, 2)
    decisions = [gate.depth(4, "lookup-1", "lookup") for _ in range(40 + 80 + 160)]
    explored = [i for i, (_, why) in enumerate(decisions) if why == "explored"]
    # a 3-row trial costs 1.2 plain steps: 1.2 / 3% = 40 steps, then twice (80), four times (160)
    assert explored == [39, 39 + 80, 39 + 80 + 160] and all(decisions[i][0] == 2 for i in explored)
    costly = _gate(compute=0.01, stall=0.0, row_cost=10.0)
    for _ in range(10):
        costly.observe_accept("lookup-1", 0, 2)
    whys = [costly.depth(2, "lookup-1", "lookup")[1] for _ in range(800)]
    assert whys.index("explored") == 700 - 1  # a 3-row verify costs 21 plain steps: 21 / 3%


def test_gate_counts_the_drafting_in_a_trial_and_backs_off_from_losing_trials():
    """A drafter whose drafting costs (the MTP layer) makes its trials rarer; a trial that finds a draft
    worth drafting starts the back-off again."""
    cheap, costly = _gate(compute=0.01, stall=0.0, row_cost=0.1), _gate(compute=0.01, stall=0.0, row_cost=0.1)
    for _ in range(3):
        costly.observe_draft("mtp", 2, 2 * 0.01)  # a plain step's time per drafted token
    for g in (cheap, costly):
        for _ in range(10):
            g.observe_accept("mtp", 0, 2)
    first = [[g.depth(2, "mtp", "mtp")[1] for _ in range(200)].index("explored") for g in (cheap, costly)]
    assert first == [39, 106]  # (1.2 + 2 * 1.0) / 3% = 107 steps: the drafting is part of the trial's cost
    # the cheap gate's next trial waits twice as long (80 steps), unless a draft paid in between
    cheap.accept["mtp"] = [99.0, 1.0]
    cheap.reach.clear()  # (the per-position counts too: acceptance as if measured anew)
    cheap._decided.clear()  # (observe_accept does this when the counts move)
    assert cheap.depth(2, "mtp", "mtp") == (2, "drafted")
    cheap.accept["mtp"] = [0.0, 99.0]
    cheap._decided.clear()
    whys = [cheap.depth(2, "mtp", "mtp")[1] for _ in range(100)]
    assert whys.index("explored") == 39  # 40 steps again, not 80


def test_a_trial_accepted_whole_is_followed_at_once_by_a_deeper_one():
    """A copy: the first trial's 2 drafts are accepted, so the next step tries 4. With a verify measured
    at two sizes, its cost per row is the slope between them (0.25 plain steps here), not the line
    through a plain step that charged the verify's fixed cost to every row (0.75): depth 8 pays and is
    drafted. The old rule (trials of 2 only, 40 steps apart) found no depth worth drafting."""
    gate = _gate(compute=0.001, stall=0.0, row_cost=1.0)
    decisions = []
    while not decisions or decisions[-1][1] != "explored":  # gated off until the first trial
        decisions.append(gate.depth(8, "lookup-4", "lookup"))
    assert decisions[-1] == (2, "explored") and {why for _, why in decisions[:-1]} == {"gated off"}
    gate.observe(3, 0.0025, 0.0, 0)  # 3 rows: 2.5 plain steps
    gate.observe_accept("lookup-4", 2, 2)
    assert gate.depth(8, "lookup-4", "lookup") == (4, "explored")
    gate.observe(5, 0.0030, 0.0, 0)  # 5 rows: 3 plain steps
    gate.observe_accept("lookup-4", 4, 4)
    k, why = gate.depth(8, "lookup-4", "lookup")
    assert why == "drafted" and k >= 6
    # a trial not accepted whole sends the next one back to EXPLORE_DEPTH
    other = _gate(compute=0.001, stall=0.0, row_cost=1.0)
    while other.depth(8, "lookup-4", "lookup")[1] != "explored":
        pass
    other.observe(3, 0.0025, 0.0, 0)
    other.observe_accept("lookup-4", 1, 2)
    assert other._trial_depth == spec_gate.EXPLORE_DEPTH and other.depth(8, "lookup-4", "lookup") == (0, "gated off")


def test_a_trial_accepted_whole_is_not_followed_by_a_deeper_one_its_drafting_alone_cannot_pay_for():
    """The same copy's trial with a drafter whose every token costs 0.8 of a plain step (a small
    model's MTP layer): 4 drafts cost 3.2 steps before any verify row beyond the 3 measured (2.5), and
    5 tokens cannot repay 5.7 steps; the next trial stays at 2, after the back-off. The same trial with
    free drafting goes deeper at once (above)."""
    gate = _gate(compute=0.001, stall=0.0, row_cost=1.0)
    while gate.depth(8, "mtp", "mtp")[1] != "explored":
        pass
    gate.observe_draft("mtp", 2, 2 * 0.0008)
    gate.observe_draft("mtp", 2, 2 * 0.0008)  # (the first measurement only stands in)
    gate.observe(3, 0.0025, 0.0, 0)
    gate.observe_accept("mtp", 2, 2)
    assert gate._trial_depth == spec_gate.EXPLORE_DEPTH and gate.depth(8, "mtp", "mtp") == (0, "gated off")


def test_gate_vetoes_drafting_that_measured_slower_per_token_than_plain_steps():
    """The model says a well-accepted draft pays (reads dominate, rows share them), but the drafted steps
    really took 3 ms a token against plain steps' 1 ms (what the model cannot see: the reads they
    caused later): after VETO_MIN drafted steps, drafting is vetoed for VETO_FIRST decisions, then
    measured afresh; a second veto in a row lasts twice as long. Drafted steps that measure faster are
    never vetoed."""
    def gate_drafting():
        gate = _gate(compute=0.002, stall=0.05, union_power=0.2, row_cost=0.2)
        for _ in range(10):
            gate.observe_accept("lookup-2", 2, 2)
        for _ in range(20):
            gate.observe_rate(False, 0.001, 1)
        assert gate.depth(4, "lookup-2", "lookup")[1] == "drafted"
        return gate

    slow = gate_drafting()
    for _ in range(spec_gate.VETO_MIN):
        assert slow.depth(4, "lookup-2", "lookup")[1] == "drafted"
        slow.observe_rate(True, 0.009, 3)
    whys = [slow.depth(4, "lookup-2", "lookup")[1] for _ in range(spec_gate.VETO_FIRST)]
    assert set(whys) <= {"vetoed", "explored"} and whys.count("vetoed") >= spec_gate.VETO_FIRST - 2
    assert slow.depth(4, "lookup-2", "lookup")[1] == "drafted"  # measured afresh
    for _ in range(spec_gate.VETO_MIN):
        slow.observe_rate(True, 0.009, 3)
        slow.depth(4, "lookup-2", "lookup")
    whys = [slow.depth(4, "lookup-2", "lookup")[1] for _ in range(2 * spec_gate.VETO_FIRST)]
    assert "drafted" not in whys[:2 * spec_gate.VETO_FIRST - spec_gate.VETO_MIN]  # the second veto: twice as long

    fast = gate_drafting()
    for _ in range(5 * spec_gate.VETO_MIN):
        fast.observe_rate(True, 0.0015, 3)
        assert fast.depth(4, "lookup-2", "lookup")[1] == "drafted"


def test_gate_goes_idle_after_a_run_of_gated_off_decisions():
    """After OFF_RUN gated-off decisions in a row, the steps until the next trial are plain ones, the
    drafter not asked (idle_steps); a trial's outcome is decided on again before going idle."""
    gate = _gate(compute=0.01, stall=0.0, row_cost=0.1)
    for _ in range(10):
        gate.observe_accept("lookup-1", 0, 2)
    assert gate.idle_steps() == 0  # some depth could pay at acceptance 1: the drafter is asked
    for _ in range(spec_gate.OFF_RUN - 1):
        assert gate.depth(2, "lookup-1", "lookup") == (0, "gated off")
    assert gate.idle_steps() == 0
    gate.depth(0, "", "")  # a step the drafter had nothing for: neither a decision nor the end of the run
    gate.depth(2, "lookup-1", "lookup")
    idle = gate.idle_steps()
    assert idle == 40 - spec_gate.OFF_RUN - 1  # the rest of the wait for the trial (40 steps, above)
    gate.skipped(idle)
    assert gate.depth(2, "lookup-1", "lookup") == (2, "explored")
    assert gate.idle_steps() == 0  # what the trial measured is decided on first


def test_gate_stays_awake_through_short_offers_where_a_longer_one_would_be_drafted():
    """A copy's offers run short where its source ends (2 tokens: a 3-row verify that does not pay),
    then long again: those gated-off decisions do not send the gate idle, or the next long offer
    (depth 8, which pays) would go unasked for the steps until a trial. A kind of draft that pays at
    no depth still goes idle after OFF_RUN of them (test above)."""
    gate = _gate(compute=0.001, stall=0.0, row_cost=1.0)
    gate.observe(3, 0.0030, 0.0, 0)  # 3 rows: 3 plain steps
    gate.observe(9, 0.0040, 0.0, 0)  # 9 rows: 4 plain steps
    gate.accept["lookup-4"] = [99.0, 1.0]
    assert gate.depth(2, "lookup-4", "lookup") == (0, "gated off")
    for _ in range(3 * spec_gate.OFF_RUN):
        gate.depth(2, "lookup-4", "lookup")
    assert gate.idle_steps() == 0  # the drafter is still asked every step
    k, why = gate.depth(8, "lookup-4", "lookup")
    assert why == "drafted" and k == 8


def test_gate_drafts_only_with_a_margin_over_a_plain_step():
    """A depth modelled barely faster than a plain step (within DRAFT_GAIN) is not drafted: the
    estimates are measured on a busy machine."""
    gate = _gate(compute=0.01, stall=0.0, row_cost=0.5)
    for _ in range(2):
        gate.observe(2, 0.0105 + 0.0, 0.0, 0)  # a 2-row verify: 1.05 plain steps
    gate.accept["lookup-2"] = [1.0, 99.0]  # acceptance about 2%: 1.02 tokens a step
    gate.accept["lookup-4"] = [99.0, 1.0]  # about 98%: 1.98 tokens a step
    assert gate.depth(1, "lookup-2", "lookup") == (0, "gated off")  # 1.02 / 1.05 < 1.05
    assert gate.depth(1, "lookup-4", "lookup") == (1, "drafted")


def test_gate_expects_what_each_draft_position_measured_not_a_geometric_series():
    """Acceptance is measured per draft position, given the drafts before it were accepted: drafts
    accepted in runs (a copy's: whole, or rejected at the first token) and drafts accepted one by one at
    the same rate are told apart, each priced at the tokens it really gives, and drafted as deep as pays."""
    def gate():
        g = _gate(compute=0.01, stall=0.0)
        for rows in (3, 9):  # a verify: a plain step and 0.45 of one per extra row
            for _ in range(2):
                g.observe(rows, 0.01 * (1 + 0.45 * (rows - 1)), 0.0, 0)
        return g
    runs, one_by_one = gate(), gate()
    for i in range(100):  # 60%: all eight accepted; 40%: the first rejected. 1 + 0.6 * 8 = 5.8 tokens a step
        runs.observe_accept("lookup-4", *((8, 8) if i % 5 in (0, 2, 4) else (0, 1)))
    rng = random.Random(0)
    accepted_runs = []
    for _ in range(200):  # each draft accepted with probability 0.85, whatever came before
        accepted = 0
        while accepted < 8 and rng.random() < 0.85:
            accepted += 1
        accepted_runs.append(accepted)
        one_by_one.observe_accept("lookup-4", accepted, min(accepted + 1, 8))
    assert runs.expected(8, "lookup-4") == pytest.approx(5.8, abs=0.3)
    # the series over the same overall acceptance (0.92 here) would promise 6.5: wrong by 12%
    assert expected_tokens(8, runs.acceptance("lookup-4")) > 6.3
    # one by one: what the steps gave (recent ones weighing more, as the counts fade), and the series
    fades = [spec_gate.ACCEPT_DECAY ** (len(accepted_runs) - 1 - i) for i in range(len(accepted_runs))]
    gave = 1 + sum(f * a for f, a in zip(fades, accepted_runs)) / sum(fades)
    assert one_by_one.expected(8, "lookup-4") == pytest.approx(gave, abs=0.1)
    assert one_by_one.expected(8, "lookup-4") == pytest.approx(expected_tokens(8, one_by_one.acceptance("lookup-4")),
                                                                abs=0.3)
    # each drafted as deep as its own shape pays: runs all eight, one by one a few
    assert runs.depth(8, "lookup-4", "lookup") == (8, "drafted")
    k, why = one_by_one.depth(8, "lookup-4", "lookup")
    assert why == "drafted" and 2 <= k <= 4
    # unmeasured positions fall back on the overall acceptance: the series itself
    fresh = gate()
    fresh.accept["mtp"] = [9.0, 1.0]
    assert fresh.expected(5, "mtp") == pytest.approx(expected_tokens(5, fresh.acceptance("mtp")))


def test_gate_prices_verify_sizes_on_one_line_through_their_measurements():
    """A verify's cost per size is the line through every measured size, each weighing the measurements
    its estimate holds: a size drafted twice on a busy machine (8 rows at 4.5 plain steps) does not make
    it dearer than the size measured often (9 rows at 3.8), which would keep the gate off the deeper."""
    gate = _gate(compute=0.01, stall=0.0)
    for rows, plain_steps, times in ((3, 2.0, 5), (5, 2.6, 5), (9, 3.8, 5), (8, 4.5, 2)):
        for _ in range(times):
            gate.observe(rows, 0.01 * plain_steps, 0.0, 0)
    costs = [gate.compute_of(n) for n in range(2, 10)]
    assert costs == sorted(costs) and gate.compute_of(8) < gate.compute_of(9)
    assert gate.compute_of(9) == pytest.approx(0.038, rel=0.1) and gate.compute_of(3) == pytest.approx(0.02, rel=0.15)
    assert gate.compute_of(1) == pytest.approx(0.01)  # a plain step: its own


def test_a_verify_size_measured_slow_once_does_not_hold_the_gate_shallow():
    """The gate drafts only the depths its line says pay, so a size measured slow once (a stall, a first
    call's one-time costs) would never be measured again: it leaves the line after FIT_STALE verifies
    without it, the gate drafts deep again and measures the size afresh. Copy-like drafts (runs accepted
    whole); a verify costs a plain step and 0.35 of one a row."""
    def true_cost(rows):
        return 0.01 * (1 + 0.35 * (rows - 1))

    gate = _gate(compute=0.01, stall=0.0, row_cost=0.5)
    for rows in (3, 5):
        for _ in range(2):
            gate.observe(rows, true_cost(rows), 0.0, 0)
    gate.observe(8, 4 * true_cost(8), 0.0, 0)  # once, at four times its cost
    for _ in range(20):
        gate.observe_accept("lookup-4", 8, 8)
    rng = random.Random(0)
    depths = []
    steps = 3 * spec_gate.FIT_STALE
    assert steps <= 400  # (the gate must recover within a few hundred verifies)
    for _ in range(steps):
        k, why = gate.depth(8, "lookup-4", "lookup")
        depths.append(k)
        if k:
            gate.observe(k + 1, true_cost(k + 1), 0.0, 0)
            accepted = k if rng.random() < 0.9 else rng.randrange(k)
            gate.observe_accept("lookup-4", accepted, min(k, accepted + 1))
    assert max(depths[:8]) <= 5  # the slow measurement steers the gate shallow at first ...
    assert depths[-64:].count(8) > 0.9 * 64  # ... not for good
    assert gate.compute_of(8) == pytest.approx(true_cost(8), rel=0.1)


def test_gate_measures_verify_cost_and_union_online():
    gate = _gate(compute=0.01, stall=0.04)
    assert gate.compute_of(5) == pytest.approx(0.05)  # the prior: each row a plain step
    for _ in range(2):  # the first of a size only stands in until the second
        gate.observe(5, 0.01 * 1.4 + 0.05, 0.05, int((1 << 20) * 1.25))
    assert gate.compute_of(5) == pytest.approx(0.014)  # rows that shared their reads: cheaper than steps
    assert gate.compute_of(3) < 0.014
    assert gate.union_power.value < 1.0  # the bytes grew less than independent routing says


def test_gate_off_run_is_the_plain_run(tmp_path):
    d = make_tiny(tmp_path / "m")
    with Engine(d, config()) as e:
        plain = generate(e, PROMPT, 20, Sampler()).output_ids
        assert e.speculator is None
    with Engine(d, config(draft="gate")) as e:
        gated = generate(e, PROMPT, 20, Sampler()).output_ids
        stats = e.speculator.stats
    assert gated == plain
    assert stats.decisions.get("gated off", 0) + stats.decisions.get("measuring", 0) > 0


# --- prompt lookup ----------------------------------------------------------------------------------

def test_prompt_lookup_longest_recent_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    lookup = PromptLookup(seq)
    assert lookup.offer(3) == (3, "lookup-3")
    assert lookup.propose(2) == Draft([7, 5], "lookup-3")  # the most recent "1 2 3" is followed by 7
    seq = [4, 4, 8]
    lookup = PromptLookup(seq)
    assert lookup.offer(2) == (0, "")  # "8" never seen before
    seq.append(4)
    assert lookup.offer(2) == (2, "lookup-1") and lookup.propose(2) == Draft([8, 4], "lookup-1")  # "4" last at 1
    seq += [4]
    assert lookup.offer(2) == (2, "lookup-2") and lookup.propose(2).tokens == [8, 4]  # "4 4" seen at 0


def test_prompt_lookup_prefers_a_recent_match_with_all_k_tokens_after_it():
    """A copy in progress: the suffix "5 6" last occurred two tokens back, in the output itself,
    where only one token follows; the copy's source, further back, has all four. Asked for one
    token, the most recent occurrence is still the one (it has the one token after it)."""
    source = [5, 6, 11, 12, 13, 14, 15]
    seq = [1, 2, *source, 3, 5, 6, 9, 5, 6]
    lookup = PromptLookup(seq)
    assert lookup.offer(4) == (4, "lookup-2") and lookup.propose(4).tokens == [11, 12, 13, 14]
    assert lookup.offer(1) == (1, "lookup-2") and lookup.propose(1).tokens == [9]
    short = [7, 8, 7, 8, 7]  # "7 8 7" only too near the end for 3: the most recent, cut short
    lookup = PromptLookup(short)
    assert lookup.offer(3) == (2, "lookup-3") and lookup.propose(3).tokens == [8, 7]


def _lookup_by_definition(seq: list[int], k: int, max_ngram: int = 4) -> Draft:
    """PromptLookup's rule, spelled out over every n-gram: the longest suffix n-gram with an earlier
    occurrence followed by a token; among its k + 1 most recent occurrences the most recent with k
    tokens after it, else the most recent."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), 0, -1):
        starts = [s for s in range(0, L - n) if seq[s:s + n] == seq[L - n:]]
        if starts:
            start = starts[-1]
            for earlier in reversed(starts[-(k + 1):]):
                if earlier + n + k <= L:
                    start = earlier
                    break
            return Draft(seq[start + n:start + n + k], f"lookup-{n}")
    return Draft()


@pytest.mark.parametrize("vocab", [2, 5, 300])
def test_prompt_lookup_scan_is_the_rule_on_growing_sequences(vocab):
    """The vectorised scan (few candidates in Python, many in numpy: a vocabulary of 2 gives
    hundreds) proposes what the rule's definition does, as the sequence grows and is copied from."""
    g = torch.Generator().manual_seed(vocab)
    seq = torch.randint(0, vocab, (40,), generator=g).tolist()
    lookup = PromptLookup(seq)
    for step in range(260):
        for k in (1, 3, 8):
            found = lookup.offer(k)
            assert (found, lookup.propose(k)) == ((len(_lookup_by_definition(seq, k).tokens),
                                                   _lookup_by_definition(seq, k).source),
                                                  _lookup_by_definition(seq, k)), (vocab, step, k)
        # grow: mostly a copy of an earlier stretch, sometimes a fresh token
        if step % 7 == 0:
            seq.append(int(torch.randint(0, vocab, (1,), generator=g)))
        else:
            seq.append(seq[len(seq) // 3 + step % 5])


def test_prompt_lookup_on_repeated_text_accepts_nearly_all(tmp_path):
    """A prompt holding a text twice, verbatim, that the model goes on repeating: nearly every
    drafted token is accepted. The text is the model's own cycle: with layers that add little to
    the embedding (initializer_range 0.002), greedy decoding follows a function of the last token
    and falls into a cycle, which the prompt then holds twice."""
    d = make_tiny(tmp_path / "m", initializer_range=0.002, routing_skew=0.0)
    with Engine(d, config()) as e:
        text = generate(e, [5, 17, 33], 48, Sampler()).output_ids
    last = len(text) - 1
    period = next(p for p in range(1, last) if text[last - p] == text[last])
    cycle = text[-period:]
    assert text[-2 * period:] == cycle * 2  # the text, repeated verbatim
    prompt = cycle * 2
    with Engine(d, config()) as e:
        plain = generate(e, prompt, 40, Sampler()).output_ids
    with Engine(d, config(draft="fixed", draft_depth=6)) as e:
        drafted = generate(e, prompt, 40, Sampler()).output_ids
        stats = e.speculator.stats
    assert drafted == plain
    assert stats.drafted >= 30 and stats.accepted >= 0.9 * stats.drafted
    assert stats.emitted / stats.steps > 4


def test_draft_knobs_validate():
    with pytest.raises(ConfigError, match="draft must be"):
        EngineConfig(draft="always")
    with pytest.raises(ConfigError, match="draft_depth must be"):
        EngineConfig(draft_depth=0)
    assert spec_gate.ACCEPT_PRIOR == (1.0, 1.0)


# --- serve: the same answer, and /metrics counts the drafts ------------------------------------------

def test_serve_answers_the_same_with_drafts_and_metrics_count_them(tmp_path):
    from test_serve import Server
    d = make_tiny(tmp_path / "m", initializer_range=0.002, routing_skew=0.0)
    with Engine(d, config()) as e:  # the model's own cycle (test_prompt_lookup_on_repeated_text_...)
        prompt = generate(e, [5, 17, 33], 48, Sampler()).output_ids[-24:]

    def answer(server):
        done = server.client().completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
        return done.choices[0].text

    plain = Server(d, EngineConfig(ctx_size=256))
    try:
        want = answer(plain)
    finally:
        plain.uv.should_exit = True
    drafting = Server(d, EngineConfig(ctx_size=256, draft="fixed", draft_depth=4))
    try:
        assert answer(drafting) == want
        drafting.wait_idle()
        assert drafting.metric("colibri_drafted_tokens_total") > 0
        assert drafting.metric("colibri_draft_accepted_tokens_total") > 0
        assert drafting.metric("colibri_draft_tokens_per_step") > 1.0
        text = httpx.get(drafting.base + "/metrics").text
        assert 'colibri_draft_decisions_total{reason="fixed"}' in text
    finally:
        drafting.uv.should_exit = True


# --- drafts as prefetch hints ---------------------------------------------------------------------

def test_drafts_hint_the_first_layers_and_change_no_token(tmp_path):
    """Streaming under a budget: the step's rows (drafts included) hint the first MoE layer, which
    the model's own lookahead cannot; the store counts those hints in its recall; tokens as resident."""
    from test_streaming import budget_for_cache
    d = make_tiny(tmp_path / "m", initializer_range=0.002, routing_skew=0.0)
    with Engine(d, config()) as e:
        prompt = generate(e, [5, 17, 33], 48, Sampler()).output_ids[-24:]
        want = generate(e, prompt, 20, Sampler()).output_ids
    kw = dict(draft="fixed", draft_depth=3, prefetch_depth=1)
    budget = budget_for_cache(d, config(**kw), 6) + (2 << 20)
    recalls = {}
    for hints in (True, False):
        with Engine(d, config(ram_budget=budget, **kw)) as e:
            assert e.plan.streaming and e.speculator.hints
            e.speculator.hints = hints
            e.store.reset_stats()
            assert generate(e, prompt, 20, Sampler()).output_ids == want
            recalls[hints] = (e.store.recall_total, e.store.stats()["lookahead_recall"])
    assert recalls[True][0] > recalls[False][0]  # layer 0's lookups now have a prediction to count


def test_idle_steps_ask_no_drafter_but_streamed_still_hint_the_lookup_guess(tmp_path, monkeypatch):
    """Gated off for good (idle_steps): resident, the drafter is never asked; streamed, prompt
    lookup's guess at the next token is still hinted (as gated-off steps hint it before they go
    idle; the step's own token is not: the model's lookahead hints its layers) where that kind of
    guess has been the next token at least GUESS_HINT_ACCEPTANCE of the time over GUESS_HINT_EVIDENCE
    guesses, and never where the guesses are wrong (their reads would be bytes the step does not
    need; and once the record says so, only one idle step in GUESS_SAMPLE still asks). Tokens as
    without drafting, either way."""
    from test_streaming import budget_for_cache
    d = make_tiny(tmp_path / "m", initializer_range=0.002, routing_skew=0.0)
    with Engine(d, config()) as e:
        prompt = generate(e, [5, 17, 33], 48, Sampler()).output_ids[-24:]  # it repeats: lookup matches
        want = generate(e, prompt, 20, Sampler()).output_ids
    offers = []
    real_offer, real_propose = PromptLookup.offer, PromptLookup.propose
    monkeypatch.setattr(PromptLookup, "offer", lambda self, k: offers.append(k) or real_offer(self, k))
    kw = dict(draft="gate", drafter="lookup", prefetch_depth=1)
    for streams, right in ((False, True), (True, True), (True, False)):
        # wrong guesses: each the true guess's neighbour in the vocabulary
        monkeypatch.setattr(PromptLookup, "propose", real_propose if right else (
            lambda self, k: Draft([t + 1 for t in real_propose(self, k).tokens],
                                              real_propose(self, k).source)))
        # (measured now: the process's resident set grows with the engines before, and the plan reads it)
        budget = budget_for_cache(d, config(**kw), 6) + (2 << 20) if streams else 0
        with Engine(d, config(ram_budget=budget, **kw)) as e:
            monkeypatch.setattr(e.speculator.gate, "idle_steps", lambda: 1000)
            hinted = []
            real_hint = e.speculator._hint
            monkeypatch.setattr(e.speculator, "_hint", lambda tokens: hinted.append(list(tokens)) or real_hint(tokens))
            offers.clear()
            assert generate(e, prompt, 20, Sampler()).output_ids == want
            if not budget:
                assert offers == [] and hinted == []
                continue
            assert e.speculator.hints
            if right:  # one lookup per decode step: its guesses are trusted
                assert len(offers) == 19
            else:  # once the record says no kind is trusted, one step in GUESS_SAMPLE asks
                assert speculative.GUESS_HINT_EVIDENCE <= len(offers) < 19
            assert all(len(h) == 1 for h in hinted)  # the guess alone: not the step's own token
            records = e.speculator._guesses
            assert records and sum(r.seen for r in records.values()) > speculative.GUESS_HINT_EVIDENCE
            most = max(r.seen for r in records.values())
            if right:  # hinted once the guesses' own record holds enough of them (each one right)
                assert all(r.right == r.seen for r in records.values())
                assert len(hinted) >= most - speculative.GUESS_HINT_EVIDENCE - 1 > 0
            else:
                assert hinted == [] and most >= speculative.GUESS_HINT_EVIDENCE
                assert all(r.right < speculative.GUESS_HINT_ACCEPTANCE * r.seen for r in records.values())


def test_greedy_accept_takes_every_rows_argmax_at_once_and_stops_where_plain_decoding_would():
    """With nothing shaping the logits, the greedy accept picks every row's argmax in one call and
    checks finiteness once: the same tokens as row by row (ties included: the first maximum), and a
    NaN is an error only in a row plain decoding reaches (before the first rejected draft)."""
    from engine.base.errors import ModelFormatError
    from engine.run.generate import check_finite_logits
    from engine.run.speculative import Steps, accept_rows

    def accept(logits, drafts, unshaped):
        out: list[int] = []
        steps = Steps(Sampler(), lambda raw: (check_finite_logits(raw), raw)[1], lambda t, raw: out.append(t),
                      lambda t: False, 10 ** 6, None, unshaped=unshaped)
        gen = type("G", (), {})()
        gen.token_seconds, gen.output_ids = [], out
        return accept_rows(steps, gen, logits, drafts, 0.0)

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (9, 50), generator=g).float()  # many ties
    best = [int(torch.argmax(row)) for row in logits]
    for drafts in (best[:8], best[:3] + [(best[3] + 1) % 50] + best[4:8], []):
        assert accept(logits, drafts, True) == accept(logits, drafts, False)
    bad = logits.clone()
    bad[5, 7] = float("nan")
    assert accept(bad, best[:3] + [(best[3] + 1) % 50] + best[4:8], True)[:2] == ([*best[:3], best[3]], 3)
    with pytest.raises(ModelFormatError, match="NaN logits"):
        accept(bad, best[:8], True)
