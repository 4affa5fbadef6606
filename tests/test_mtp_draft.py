"""Drafting with the checkpoint's multi-token-prediction layer (engine/arch/mtp.py,
engine/run/mtp_drafter.py): synth writes the layer as DeepSeek-V3 publishes it for the three
architectures that have one; greedy output with MTP drafts is the output without them (bf16 and
fp32, resident and streamed: its experts go through the store as layer L); an MTP layer that
predicts the token after next is accepted (the pairing of token j+1 with the hidden state at j, and
the chained drafts, are right); the memory plan charges it; asking for it where there is none is one
clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import synth
from engine.arch.mtp import extra_names, with_mtp_layers
from engine.base.config import EngineConfig
from engine.base.errors import ConfigError, DraftBudgetError
from engine.format.checkpoint import Checkpoint
from engine.run.generate import Sampler, generate
from engine.run import mtp_drafter
from engine.run.mtp_drafter import MtpDrafter
from engine.run.runtime import Engine
from colibri_tiny import make_tiny
from test_streaming import budget_for_cache
from test_synth_archs import tiny_geometry

PRESETS = {"deepseek_v3": "deepseek-v3-small", "glm4_moe": "glm4-moe-small", "glm_moe_dsa": "glm-5-small"}
PROMPT = [(11 * i + 5) % 256 for i in range(24)]
CTX = 96


def mtp_model(tmp_path_factory, arch: str, **geometry):
    d = tmp_path_factory.mktemp(f"mtp-{arch}")
    g = {**tiny_geometry(PRESETS[arch]), "num_nextn_predict_layers": 1, "max_shard_size": 1 << 30, **geometry}
    return synth.synthesize(g, d / "m", seed=5, progress=False)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def model(request, tmp_path_factory):
    return request.param, mtp_model(tmp_path_factory, request.param)


def config(**kw):
    return EngineConfig(ctx_size=CTX, threads=1, **kw)


def test_synth_writes_the_mtp_layer_as_published(model):
    arch, d = model
    ckpt = Checkpoint(d)
    L = ckpt.config["num_hidden_layers"]
    assert ckpt.config["num_nextn_predict_layers"] == 1
    from engine.arch.registry import model_args
    args = model_args(ckpt.config)
    for name, shape in extra_names(args, L).items():
        assert ckpt.info(name).shape == shape
    assert ckpt.info(f"model.layers.{L}.embed_tokens.weight").shape == (args.vocab_size, args.hidden_size)
    assert any(n.startswith(f"model.layers.{L}.mlp.experts.") for n in ckpt.tensors)
    if arch == "glm_moe_dsa":
        assert f"model.layers.{L}.self_attn.indexer.wk.weight" in ckpt.tensors
    with Engine(d, config()) as e:  # drafting off: recognised and skipped, as before
        assert e.mtp is None and e.skipped["mtp_layers"] == [L]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_tokens_identical_with_mtp_drafts(model, dtype):
    _, d = model
    with Engine(d, config(dtype=dtype)) as e:
        plain = generate(e, PROMPT, 20, Sampler()).output_ids
    with Engine(d, config(dtype=dtype, draft="fixed", drafter="mtp", draft_depth=3)) as e:
        assert e.mtp is not None
        drafted = generate(e, PROMPT, 20, Sampler()).output_ids
        stats = e.speculator.stats
    assert drafted == plain and stats.drafted > 0


def test_mtp_experts_stream_through_the_store(model):
    """Under a budget the MTP layer's experts are layer L of the streamed layout: read from disk
    like any layer's, and the tokens do not change."""
    arch, d = model
    L = Checkpoint(d).config["num_hidden_layers"]
    with Engine(d, config(dtype="fp32")) as e:
        plain = generate(e, PROMPT, 12, Sampler()).output_ids
    budget = budget_for_cache(d, config(dtype="fp32", draft="fixed", drafter="mtp"), 4) + (4 << 20)
    with Engine(d, config(dtype="fp32", draft="fixed", drafter="mtp", draft_depth=2, ram_budget=budget)) as e:
        assert e.plan.streaming and (L, 0) in e.layout.keys()
        drafted = generate(e, PROMPT, 12, Sampler()).output_ids
        assert any(layer == L for layer, _ in e.store.read_counts)
    assert drafted == plain


def test_the_plan_charges_the_mtp_layer(model):
    _, d = model
    with Engine(d, config(dtype="fp32", draft="gate", drafter="lookup")) as lookup, \
            Engine(d, config(dtype="fp32", draft="gate", drafter="mtp")) as mtp:
        assert mtp.plan.draft_bytes > lookup.plan.draft_bytes
        assert mtp.plan.routed_experts == lookup.plan.routed_experts + lookup.args.num_experts
        assert mtp.layout.num_routed > lookup.layout.num_routed


def test_an_mtp_layer_that_does_not_fit_beside_the_prompt_group_is_refused_not_squeezed(model, monkeypatch):
    """Where the MTP layer's bytes do not fit beside the prompt group decoding without drafts uses, the
    plan does not shrink the group (that changes a prompt's bits, so tokens): drafter mtp is one
    DraftBudgetError naming what drafting needs; drafter auto drafts with prompt lookup alone, and
    its tokens are the plain ones."""
    _, d = model
    budget = budget_for_cache(d, config(dtype="fp32"), 4) + (32 << 20)  # slack: the largest group, whatever RSS does
    with Engine(d, config(dtype="fp32", ram_budget=budget)) as e:
        plain = generate(e, PROMPT, 12, Sampler()).output_ids
        group = e.plan.prefill_group
    big = mtp_drafter.planned_bytes
    monkeypatch.setattr(mtp_drafter, "planned_bytes",  # an MTP layer of 64 MiB more
                        lambda ckpt, args, layer, *a: big(ckpt, args, layer, *a) + (0 if layer is None else 64 << 20))
    with pytest.raises(DraftBudgetError, match=f"beside the {group}-token prompt groups.*drafting needs"):
        Engine(d, config(dtype="fp32", ram_budget=budget, draft="gate", drafter="mtp"))
    with Engine(d, config(dtype="fp32", ram_budget=budget, draft="fixed", draft_depth=3, drafter="auto")) as e:
        assert e.mtp is None and e.mtp_layer is None and e.plan.prefill_group == group
        assert generate(e, PROMPT, 12, Sampler()).output_ids == plain


def _as_oracle(d):
    """Rewrite the MTP module so that it predicts what the model predicts one token later: with
    layers that add little to the embedding (initializer_range 0.002), the model's next token is a
    function of its input token, f(t); an MTP layer that passes the embedding of t[j+1] through
    (eh_proj = [I | 0]) to the model's own head predicts f(t[j+1]) = t[j+2]."""
    path = d / "model.safetensors"
    tensors = load_file(path)
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    H = tensors["model.norm.weight"].shape[0]
    eh = torch.zeros(H, 2 * H, dtype=tensors[f"model.layers.{L}.eh_proj.weight"].dtype)
    eh[:, :H] = torch.eye(H)
    tensors[f"model.layers.{L}.eh_proj.weight"] = eh
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_an_mtp_layer_that_predicts_right_is_accepted(arch, tmp_path_factory):
    d = mtp_model(tmp_path_factory, arch, initializer_range=0.002, routing_skew=0.0)
    _as_oracle(d)
    with Engine(d, config(dtype="fp32")) as e:
        plain = generate(e, PROMPT, 30, Sampler()).output_ids
    with Engine(d, config(dtype="fp32", draft="fixed", drafter="mtp", draft_depth=4)) as e:
        drafted = generate(e, PROMPT, 30, Sampler()).output_ids
        stats = e.speculator.stats
    assert drafted == plain
    assert stats.drafted >= 20 and stats.accepted >= 0.9 * stats.drafted
    assert stats.emitted / stats.steps > 3


def test_drafter_mtp_without_a_layer_is_one_clear_error(tmp_path):
    d = make_tiny(tmp_path / "m")
    with pytest.raises(ConfigError, match="drafter mtp: qwen3_moe has no MTP layers"):
        Engine(d, config(draft="gate", drafter="mtp"))
    with Engine(d, config(draft="gate", drafter="auto")) as e:  # auto: lookup alone
        assert e.mtp is None


def test_with_mtp_layers_extends_the_layer_list():
    from engine.arch.registry import model_args
    cfg = json.loads(json.dumps(synth.load_preset("glm-5-small")))
    from engine.synth.hf_files import hf_config
    args = model_args(hf_config({**cfg, **tiny_geometry("glm-5-small")}, 0, 0.0))
    ext = with_mtp_layers(args, 1)
    L = args.num_layers
    assert ext.num_layers == L + 1 and ext.is_moe_layer(L) and L in ext.attention_impl.indexer.full_layers
    assert with_mtp_layers(args, 0) is args


# --- the MTP layer costs nothing while drafting is off (engine/run/mtp_drafter.py) -------------------

def _count_layer_rows(monkeypatch) -> list[int]:
    """Rows of every MtpLayer.forward call from now on."""
    from engine.arch.mtp import MtpLayer
    rows: list[int] = []
    real = MtpLayer.forward

    def counted(self, tokens, hidden, start_pos, **kw):
        rows.append(int(tokens.shape[0]))
        return real(self, tokens, hidden, start_pos, **kw)

    monkeypatch.setattr(MtpLayer, "forward", counted)
    return rows


def test_the_mtp_layer_is_not_run_while_the_gate_keeps_drafting_off(model, monkeypatch):
    """A prompt and 30 plain steps with the MTP drafter on and the gate off: not one MTP layer call,
    the pairs waiting are a window, and the tokens are the plain run's."""
    _, d = model
    with Engine(d, config(dtype="fp32")) as e:
        plain = generate(e, PROMPT, 30, Sampler()).output_ids
    with Engine(d, config(dtype="fp32", draft="gate", drafter="mtp")) as e:
        rows = _count_layer_rows(monkeypatch)
        monkeypatch.setattr(e.speculator.gate, "depth", lambda available, source, drafter: (0, "gated off"))
        out = generate(e, PROMPT, 30, Sampler()).output_ids
        assert rows == [] and e.mtp.calls == 0
        assert len(e.mtp.tokens) == mtp_drafter.WINDOW  # the last pairs only: nothing computed, nothing more kept
        assert e.mtp.waiting[0] == len(PROMPT) + 30 - 2  # the last fed position's hidden, for the next draft
    assert out == plain


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_mtp_drafts_after_a_gated_off_stretch_are_accepted(arch, tmp_path_factory, monkeypatch):
    """The gate off for longer than the window (pairs dropped), then drafting: the layer computes the
    window once (no more rows than WINDOW in a call), attends from its first position, and an MTP
    layer that predicts right is still accepted; the output is the plain run's."""
    d = mtp_model(tmp_path_factory, arch, initializer_range=0.002, routing_skew=0.0)
    _as_oracle(d)
    with Engine(d, config(dtype="fp32")) as e:
        plain = generate(e, PROMPT, 50, Sampler()).output_ids
    gap = mtp_drafter.WINDOW + 9
    with Engine(d, config(dtype="fp32", draft="fixed", drafter="mtp", draft_depth=3)) as e:
        rows = _count_layer_rows(monkeypatch)
        offers = []
        real_offer = MtpDrafter.offer

        def offer(self, k):  # nothing offered for the first `gap` steps: plain steps, pairs dropped
            offers.append(k)
            return (0, "mtp") if len(offers) <= gap else real_offer(self, k)

        monkeypatch.setattr(MtpDrafter, "offer", offer)
        drafted = generate(e, PROMPT, 50, Sampler()).output_ids
        stats = e.speculator.stats
        assert e.mtp.since == len(PROMPT) + gap - mtp_drafter.WINDOW  # the window after the gap
    assert drafted == plain
    assert rows[0] == mtp_drafter.WINDOW and max(rows) == rows[0]  # the window (this step's pair its last), once
    assert stats.drafted >= 10 and stats.accepted >= 0.9 * stats.drafted


def test_a_run_of_plain_steps_hands_over_only_the_pairs_the_next_draft_reads(tmp_path_factory, monkeypatch):
    """Where the gate takes 40 plain steps without asking, only the last window + 1 hand their hidden
    states to the MTP layer's state (the others take the plain decode route, as the engine without the
    drafter does); the draft after them reads a whole window, an MTP layer that predicts right is
    accepted, and the tokens are the plain run's."""
    from engine.arch.model import Transformer

    d = mtp_model(tmp_path_factory, "glm4_moe", initializer_range=0.002, routing_skew=0.0)
    _as_oracle(d)
    with Engine(d, config(dtype="fp32")) as e:
        plain = generate(e, PROMPT, 60, Sampler()).output_ids
    with Engine(d, config(dtype="fp32", draft="gate", drafter="mtp", draft_depth=3)) as e:
        gate, window = e.speculator.gate, e.mtp.window
        idle = iter([40])
        monkeypatch.setattr(gate, "idle_steps", lambda: next(idle, 0))
        monkeypatch.setattr(gate, "depth", lambda available, source, drafter: (min(available, 3), "drafted"))
        handed = []
        real_forward = Transformer.forward

        def forward(self, *args, hidden=None, **kw):  # a decode step: whether it hands its hidden state over
            if args[0].shape[0] == 1:
                handed.append(hidden is not None)
            return real_forward(self, *args, hidden=hidden, **kw)

        monkeypatch.setattr(Transformer, "forward", forward)
        rows = _count_layer_rows(monkeypatch)
        drafted = generate(e, PROMPT, 60, Sampler()).output_ids
        stats = e.speculator.stats
    assert handed[:40] == [False] * (40 - window - 1) + [True] * (window + 1)
    assert rows[0] == window  # the first draft computes the whole window
    assert drafted == plain
    assert stats.drafted >= 10 and stats.accepted >= 0.9 * stats.drafted


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_idle_mtp_layer_lends_its_memory_to_the_expert_cache_and_drafts_again(dtype, tmp_path_factory,
                                                                                   monkeypatch):
    """Streamed, the layer starts lent: nothing of it is loaded and the RAM cache holds its bytes (whole
    entries; with bf16 compute a cached expert is its slot, and the arena holds that many more) while
    nothing is offered, for longer than LEND_AFTER steps here; the first draft repays the cache, loads
    the layer and is accepted; the cache and arena are back to the plan's, and the tokens are the plain
    run's."""
    d = mtp_model(tmp_path_factory, "glm4_moe", initializer_range=0.002, routing_skew=0.0)
    _as_oracle(d)
    # A small share of a large budget: the cache's size then barely moves with the process's resident set,
    # which the plan reads and which drifts by megabytes in a long test process (at a 0.05 share, a drop of
    # ~10 MiB let the cache hold every expert, and nothing was left to borrow)
    base = config(dtype=dtype, draft="fixed", drafter="mtp", draft_depth=3, cpu_cache_ratio=0.002)
    with Engine(d, config(dtype=dtype)) as e:
        plain = generate(e, PROMPT, 56, Sampler()).output_ids
    with Engine(d, base) as e:  # (resident: nothing to lend to)
        mtp_bytes = e.plan.draft_bytes
        assert e.store is None or not getattr(e.store, "borrowable", 0)
    budget = budget_for_cache(d, base, 10) + mtp_bytes  # (the cache holds about half the 24 experts)
    gap = mtp_drafter.LEND_AFTER + 6
    with Engine(d, base.replace(ram_budget=budget)) as e:
        store, plan = e.store, e.plan
        assert plan.streaming and store.borrowable > 0 and plan.cache_slots + store.borrowable <= plan.routed_experts
        entry, ram = plan.cache_entry_bytes, store.cache.tier("ram")
        lendable = mtp_drafter.lendable_bytes(e.checkpoint, e.args, e.mtp_layer, e.dtype, e.kv_dtype, CTX)
        unspent = plan.unspent_cache_bytes(base.cpu_cache_ratio)
        assert 0 <= unspent and store.borrowable == min((lendable + unspent) // entry,
                                                        plan.routed_experts - plan.cache_slots)
        slot_entries = dtype == "bf16"  # the synthesized experts are bf16: views of their slots
        assert e.mtp.layer is None and store.borrowed == store.borrowable and store.arena.withheld == 0
        assert store.arena.count == plan.arena_slots + (store.borrowable if slot_entries else 0)
        assert ram.capacity_bytes == plan.cache_bytes + store.borrowable * entry
        seen, offers = [], []
        real_offer = MtpDrafter.offer

        def offer(self, k):
            offers.append(k)
            if len(offers) == gap:  # the step before the first draft: lent
                seen.append((e.mtp.layer is None, ram.capacity_bytes, store.arena.count))
            return (0, "mtp") if len(offers) <= gap else real_offer(self, k)

        monkeypatch.setattr(MtpDrafter, "offer", offer)
        drafted = generate(e, PROMPT, 56, Sampler()).output_ids
        stats = e.speculator.stats
        lent, capacity, slots = seen[0]
        assert lent and capacity == plan.cache_bytes + store.borrowable * entry
        assert slots == plan.arena_slots + (store.borrowable if slot_entries else 0)
        assert e.mtp.layer is not None and e.mtp.loads == 1 and stats.mtp_loads == 1
        assert ram.capacity_bytes == plan.cache_bytes and ram.bytes_used <= plan.cache_bytes
        assert store.arena.count == plan.arena_slots and store.slot_overflows == 0
        assert e.draft_stats()["mtp_loads"] == 1
    assert drafted == plain
    assert stats.drafted >= 9 and stats.accepted >= 0.9 * stats.drafted


@pytest.mark.parametrize("ratio", [1.0, 0.6])
def test_a_lent_cache_holds_the_entries_a_plan_without_the_drafter_would(ratio, tmp_path_factory):
    """The drafter's idle bytes join what the cache's share left below a whole entry: over budgets
    that cross every rounding of the drafter's bytes into entries, the plan's cache plus what it may
    borrow holds exactly the entries of the same plan without the drafter (ratio 1; at least them
    below 1), and never more than every routed expert."""
    from engine.arch.registry import model_args
    from engine.format.layout import ExpertLayout
    from engine.movement.cache_loan import CacheLoan
    from engine.movement.plan import make_plan
    d = mtp_model(tmp_path_factory, "glm4_moe")
    ckpt = Checkpoint(d)
    args = with_mtp_layers(model_args(ckpt.config), 1)
    layout = ExpertLayout(ckpt, args)
    cfg = config(dtype="fp32", draft="gate", drafter="mtp", cpu_cache_ratio=ratio)
    mtp = mtp_drafter.lendable_bytes(ckpt, args, ckpt.config["num_hidden_layers"], torch.float32, torch.float32, CTX)
    overhead = 64 << 20

    def plan(budget: int, mtp_bytes: int):
        return make_plan(ckpt, args, layout, cfg.replace(ram_budget=budget), torch.float32, torch.float32,
                         overhead_bytes=overhead, mtp_bytes=mtp_bytes)

    start = plan(1 << 40, 0)
    entry = start.cache_entry_bytes
    assert 0 < entry < mtp  # the drafter's bytes are whole entries and a part of one
    low = start.fixed_bytes - start.draft_bytes + plan(1 << 40, mtp).draft_bytes + entry
    seen = set()
    for i in range(40):
        budget = low + i * entry // 7
        with_mtp, without = plan(budget, mtp), plan(budget, 0)
        loan = CacheLoan()
        loan.open_loan(layout, cfg, with_mtp, torch.float32, mtp)
        lent = with_mtp.cache_slots + loan.borrowable
        seen.add(without.cache_slots - with_mtp.cache_slots)
        assert lent <= with_mtp.routed_experts
        assert lent == without.cache_slots if ratio == 1.0 else lent >= without.cache_slots
    assert len(seen) > 1  # the drafter's bytes rounded to different whole entries across the budgets


def test_engines_given_one_runtime_overhead_plan_alike_and_a_lent_cache_matches_the_plain_one(tmp_path_factory):
    """Engine(runtime_overhead_bytes=...) plans with that figure whatever the process holds: two engines of
    one config plan alike across a resident set grown by 8 MiB between them, and an MTP engine's lent cache
    then holds the plain engine's entries exactly (what a comparison of processes needs: each process's
    own resident set differs by about one small expert from the next's)."""
    d = mtp_model(tmp_path_factory, "glm4_moe")
    plain_cfg = config(dtype="fp32")
    overhead = (300 << 20) + 12345
    with Engine(d, plain_cfg.replace(ram_budget=1 << 40), runtime_overhead_bytes=overhead) as e:
        fixed, entry = e.plan.fixed_bytes, e.plan.cache_entry_bytes
    budget = fixed + 12 * entry + entry // 2  # about half the experts
    plain_cfg = plain_cfg.replace(ram_budget=budget)
    with Engine(d, plain_cfg, runtime_overhead_bytes=overhead) as e:
        first = e.plan.to_dict()
    grown = bytearray(8 << 20)
    grown[::4096] = b"x" * len(grown[::4096])  # resident, not just reserved
    with Engine(d, plain_cfg, runtime_overhead_bytes=overhead) as e:
        assert e.plan.to_dict() == first
    assert first["overhead_bytes"] == overhead and first["streaming"]
    assert 0 < first["cache_slots"] < first["routed_experts"]
    with Engine(d, plain_cfg.replace(draft="gate", drafter="mtp"), runtime_overhead_bytes=overhead) as e:
        assert e.plan.overhead_bytes == overhead and e.plan.draft_bytes > 0
        assert e.plan.cache_slots < first["cache_slots"] == e.plan.cache_slots + e.store.borrowable
    del grown
    # Across budgets that cross every rounding: drafting with the MTP layer alone, the lent cache holds the
    # plain plan's entries. What stays through a loan (the queued hidden states) would cross an entry
    # where less than a whole window's rows are left below one: there the window is shortened to fit,
    # and only where not even MIN_WINDOW's rows fit is the lent cache an entry short.
    row = 4 * Checkpoint(d).config["hidden_size"]
    queued, least = (mtp_drafter.WINDOW + 1) * row, (mtp_drafter.MIN_WINDOW + 1) * row
    fitted = set()
    with Engine(d, plain_cfg, runtime_overhead_bytes=overhead) as e:
        edge = budget - (budget - e.plan.fixed_bytes) % entry  # a whole entry: nothing left below one
    for b in ([budget + i * entry // 7 for i in range(14)]
              + [edge + queued - 1, edge + queued, edge + queued // 2, edge + least - 1, edge + least]):
        cfg = plain_cfg.replace(ram_budget=b)
        with Engine(d, cfg, runtime_overhead_bytes=overhead) as e:
            plain, left = e.plan.cache_slots, (cfg.ram_budget - e.plan.fixed_bytes) % entry
        with Engine(d, cfg.replace(draft="gate", drafter="mtp"), runtime_overhead_bytes=overhead) as e:
            lent, window = e.plan.cache_slots + e.store.borrowable, e.mtp.window
        assert lent == plain - (left < least), (b, plain, lent, left)
        if left < least:
            assert window == mtp_drafter.WINDOW  # (an entry lost whatever the window: drafts keep it whole)
        else:
            assert window == min(mtp_drafter.WINDOW, left // row - 1), (b, left, window)
        fitted.add(least <= left < queued)
    assert fitted == {False, True}  # (both cases met: the rule is not vacuous)


def test_short_loans_double_the_wait_before_the_next_and_a_long_one_resets_it():
    """Drafts every few dozen steps would pay a load each: a loan that ends within SHORT_LOAN times the
    wait before it doubles the wait (up to LEND_AFTER_MAX); a long one sets it back. Nothing is lent
    without a store that can borrow, and each loan is one borrow, each load one repay."""

    class Store:
        borrowable, borrows, repays = 3, 0, 0

        def borrow(self):
            Store.borrows += 1

        def repay(self):
            Store.repays += 1

    layer = object()
    state = mtp_drafter.MtpState(layer, load=lambda: layer, store=Store())
    assert not mtp_drafter.MtpState(layer, load=lambda: layer, store=None).lend_if_idle(10 ** 6)

    def loan(wait: int, length: int) -> int:
        state.idle = wait - 1
        assert not state.lend_if_idle() and state.layer is layer  # one step short: kept
        state.idle = wait
        assert state.lend_if_idle() and state.layer is None
        state.idle = wait + length
        assert state._ensure_loaded() is layer
        return state.lend_after

    L = mtp_drafter.LEND_AFTER
    assert loan(L, 2 * L - 1) == 2 * L  # short: the wait doubles
    assert loan(2 * L, 4 * L - 1) == 4 * L
    assert loan(4 * L, 8 * L) == L  # long: back to the start
    state.lend_after = mtp_drafter.LEND_AFTER_MAX
    assert loan(mtp_drafter.LEND_AFTER_MAX, 0) == mtp_drafter.LEND_AFTER_MAX  # capped
    assert Store.borrows == Store.repays == 4 and state.loads == 4
    state.idle = 0
    assert not state.lend_if_idle(ahead=state.lend_after - 1)
    assert state.lend_if_idle(ahead=state.lend_after) and state.layer is None  # the gate's plain run ahead


def test_the_mtp_window_reads_the_same_wherever_it_lies_and_however_its_rows_are_grouped(model):
    """The MTP layer's cache holds a window from slot 0 (MtpLayer.forward's base), RoPE turning at
    the rows' own positions: the window's logits are the same at position 7 as at 40 (attention sees
    only offsets), and the rows in one call (the verify's row path) give what one row a call (the
    decode plan's native attention and MoE) gives."""
    _, d = model
    with Engine(d, config(dtype="fp32", draft="gate", drafter="mtp")) as e:
        layer, H = e.mtp.layer, e.args.hidden_size
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(1, e.args.vocab_size, (6,), generator=g)
        hidden = torch.randn(6, H, generator=g)
        early, _ = layer.forward(tokens, hidden, 7, base=7)
        late, out = layer.forward(tokens, hidden, 40, base=40)
        one_by_one = torch.cat([layer.forward(tokens[i:i + 1], hidden[i:i + 1], 40 + i, base=40)[0] for i in range(6)])
        with pytest.raises(ValueError, match="from base 41"):
            layer.forward(tokens[:1], hidden[:1], 40, base=41)
    assert out.shape == (6, H) and late.shape == (6, e.args.vocab_size)
    torch.testing.assert_close(early, late, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(one_by_one, late, rtol=1e-4, atol=1e-4)


def test_an_mtp_head_that_is_the_lm_head_byte_for_byte_is_loaded_once(tmp_path_factory):
    """DeepSeek-V3's and GLM's files carry a copy of the shared output head as the MTP layer's
    shared_head.head: it is the model's lm_head then, not a second vocabulary-sized tensor in the
    plan. A head of its own (one byte differs) is loaded and charged."""
    d = mtp_model(tmp_path_factory, "glm4_moe")
    path = d / "model.safetensors"
    tensors = load_file(path)
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    head = f"model.layers.{L}.shared_head.head.weight"
    tensors[head] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with Engine(d, config(draft="gate", drafter="mtp")) as e:
        assert e.mtp.layer.x["head"] is e.model.lm_head
        shared = e.plan.draft_bytes
        V, H, elem = e.args.vocab_size, e.args.hidden_size, e.dtype.itemsize
    tensors[head] = tensors["lm_head.weight"].clone()
    tensors[head][-1, -1] += 1  # the last byte's element: one value differs
    save_file(tensors, str(path), metadata={"format": "pt"})
    with Engine(d, config(draft="gate", drafter="mtp")) as e:
        assert e.mtp.layer.x["head"] is not e.model.lm_head
        assert torch.equal(e.mtp.layer.x["head"].float(), tensors[head].float())
        assert e.plan.draft_bytes == shared + V * H * elem


def test_same_bytes_reads_every_chunk(tmp_path):
    """The comparison reads chunk by chunk to the end: a difference in the last chunk counts, and a
    tensor of another shape or dtype is never the same."""
    from engine.format import checkpoint
    a = torch.arange(300, dtype=torch.float32)
    b = a.clone()
    b[-1] += 1
    save_file({"a": a, "a2": a.clone(), "b": b, "c": a.clone().reshape(3, 100), "d": a.to(torch.bfloat16)},
              str(tmp_path / "t.safetensors"))
    info = checkpoint.read_safetensors_header(tmp_path / "t.safetensors")
    stamps = ("test",)
    assert checkpoint._same_bytes(info["a"], info["a2"], stamps, chunk=64)
    assert not checkpoint._same_bytes(info["a"], info["b"], stamps, chunk=64)
    assert checkpoint.same_bytes(info["a"], info["a2"]) and not checkpoint.same_bytes(info["a"], info["b"])
    assert not checkpoint.same_bytes(info["a"], info["c"]) and not checkpoint.same_bytes(info["a"], info["d"])


def test_the_tuners_plan_charges_the_mtp_layer_as_the_engine_does(model):
    """The tuner's memory plan (tuner/costmodel/memplan.py) of a config drafting with the MTP layer is
    the engine's: the layer's bytes and its experts in the layout; with drafting off, neither."""
    from tuner.costmodel.memplan import plan_memory
    from tuner.costmodel.model_geometry import resolve
    _, d = model
    g = resolve(str(d))
    for kw in (dict(draft="gate", drafter="mtp"), dict(draft="gate", drafter="auto"), dict(draft="off")):
        with Engine(d, config(**kw)) as e:
            planned = plan_memory(g, g.native_quant, config(**kw), overhead_bytes=e.plan.overhead_bytes)
            assert (planned.draft_bytes, planned.routed_experts) == (e.plan.draft_bytes, e.plan.routed_experts), kw
            assert (e.mtp is not None) == (kw.get("draft") != "off")
