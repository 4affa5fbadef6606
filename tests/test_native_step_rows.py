"""Several decode rows through every layer in one native call (decode_layers_rows_bf16 /
decode_layers_int_rows, engine/native/decode_step*.cpp; decode_plan.native_step_rows), the route
decode_rows.forward_rows takes where every row's solo decode would take the whole native step.

The rule (as tests/test_native_rows.py's for the single kernels): rows never share an accumulation,
so each row's logits are torch.equal to its solo decode, for M = 1..5 rows at consecutive positions of
one cache (a speculative verify: a row attends the earlier rows' K/V), on independent caches (a
batched step), and both at once; bf16 with a bf16 or an int8 KV cache, and int8 / int4 containers
whose every projection and expert is quantized (the whole step's int route). The cache a verify
leaves is the one decoding the rows one by one leaves.
"""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.arch import decode_plan
from engine.base.config import EngineConfig
from engine.run.runtime import Engine
from colibri_native_cases import needs_native_int
from colibri_requirements import needs
from colibri_tiny import make_tiny

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))

PROMPTS = [[(5 * i + 1) % 200 for i in range(9)], [(11 * i + 7) % 200 for i in range(4)],
           [(3 * i + 2) % 200 for i in range(13)], [(7 * i + 3) % 200 for i in range(6)],
           [(13 * i + 5) % 200 for i in range(11)]]
DRAFTS = [17, 4, 99, 23, 150]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """kind → a tiny 3-layer bf16 model's directory (every layer MoE: the whole step's route): "bf16"
    the checkpoint, "int8" / "int4" its container with every projection and expert quantized (scope
    all: the int whole step)."""
    root = tmp_path_factory.mktemp("native-step-rows")
    made = {"bf16": make_tiny(root / "bf16", dtype="bfloat16", num_hidden_layers=3)}

    def get(kind: str):
        if kind not in made:
            from engine.format.convert import convert
            made[kind] = convert(made["bf16"], root / kind, kind, group_size=32 if kind == "int4" else 64,
                                 scope="all")["path"]
        return made[kind]
    return get


@pytest.fixture
def step_rows_calls(monkeypatch):
    """The native_step_rows calls made (each a list of the rows' positions): proof the rows took the
    one-call route, not the per-layer one (which would give the same bits)."""
    calls = []
    real = decode_plan.native_step_rows

    def spy(steps, args, x, cos, sin, positions, row_cache, trim):
        calls.append(list(positions))
        return real(steps, args, x, cos, sin, positions, row_cache, trim)
    monkeypatch.setattr(decode_plan, "native_step_rows", spy)
    return calls


CASES = [pytest.param("bf16", "auto", id="bf16"), pytest.param("bf16", "int8", id="bf16-kv-int8"),
         pytest.param("int8", "auto", id="int8-all", marks=needs_native_int()),
         pytest.param("int4", "auto", id="int4-all", marks=needs_native_int())]


def _engine(model_dirs, kind, kv_dtype):
    engine = Engine(model_dirs(kind), EngineConfig(ctx_size=64, dtype="bf16", threads=1, max_batch=5,
                                                   kv_dtype=kv_dtype))
    assert engine.decode_plan.route == decode_plan.NATIVE_STEP, engine.decode_plan.describe()
    assert (engine.decode_plan.step.groups is None) == (kind == "bf16")
    return engine


@pytest.mark.parametrize("kind,kv_dtype", CASES)
def test_a_verify_of_m_rows_gives_each_its_solo_decode(model_dirs, step_rows_calls, kind, kv_dtype):
    """M = 1..5 rows at consecutive positions of one cache: row i's logits are those of decoding the
    rows one by one (it attends rows 0..i-1's K/V, written in the same call), and the cache is left
    as one-by-one decoding leaves it (the next token's logits agree)."""
    with _engine(model_dirs, kind, kv_dtype) as engine:
        prompt = PROMPTS[0]
        for M in range(1, 6):
            kv = engine.new_cache()
            engine.prefill_into(kv, prompt, 0)
            alone = [engine.model.forward(torch.tensor([t]), len(prompt) + i, kv)[-1] for i, t in enumerate(DRAFTS[:M])]
            after = engine.model.forward(torch.tensor([5]), len(prompt) + M, kv)[-1]
            kv2 = engine.new_cache()
            engine.prefill_into(kv2, prompt, 0)
            step_rows_calls.clear()
            rows = engine.decode_rows(DRAFTS[:M], [len(prompt) + i for i in range(M)], [kv2] * M)
            assert step_rows_calls == [[len(prompt) + i for i in range(M)]]
            for i, want in enumerate(alone):
                assert torch.equal(rows[i], want), f"M={M} row {i}: max |d| {(rows[i] - want).abs().max():.2e}"
            assert torch.equal(engine.model.forward(torch.tensor([5]), len(prompt) + M, kv2)[-1], after), M


@pytest.mark.parametrize("kind,kv_dtype", CASES)
def test_m_sequences_in_one_call_give_each_its_solo_decode(model_dirs, step_rows_calls, kind, kv_dtype):
    """M = 1..5 sequences of different lengths, each its own cache, then a mixed step (a three-row
    verify of one sequence beside two single rows of others): every row torch.equal to its solo decode."""
    with _engine(model_dirs, kind, kv_dtype) as engine:
        def fresh(prompts):
            kvs = [engine.new_cache() for _ in prompts]
            for kv, p in zip(kvs, prompts):
                engine.prefill_into(kv, p, 0)
            return kvs

        for M in range(1, 6):
            prompts = PROMPTS[:M]
            solo_kvs, kvs = fresh(prompts), fresh(prompts)
            alone = [engine.model.forward(torch.tensor([t]), len(p), kv)[-1]
                     for t, p, kv in zip(DRAFTS, prompts, solo_kvs)]
            step_rows_calls.clear()
            rows = engine.decode_rows(DRAFTS[:M], [len(p) for p in prompts], kvs)
            assert len(step_rows_calls) == 1
            for i, want in enumerate(alone):
                assert torch.equal(rows[i], want), f"M={M} row {i}: max |d| {(rows[i] - want).abs().max():.2e}"
        prompts = PROMPTS[:3]
        solo_kvs, kvs = fresh(prompts), fresh(prompts)
        order = [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)]  # (sequence, offset past its prompt)
        tokens = [DRAFTS[i] for i in range(len(order))]
        alone = [engine.model.forward(torch.tensor([t]), len(prompts[s]) + o, solo_kvs[s])[-1]
                 for t, (s, o) in zip(tokens, order)]
        step_rows_calls.clear()
        rows = engine.decode_rows(tokens, [len(prompts[s]) + o for s, o in order], [kvs[s] for s, _ in order])
        assert len(step_rows_calls) == 1
        for i, want in enumerate(alone):
            assert torch.equal(rows[i], want), f"mixed row {i}"


def test_rows_off_the_whole_step_keep_the_per_layer_route(model_dirs, step_rows_calls):
    """With the whole step turned off (the solo decode takes the per-layer native calls), the rows do
    too, and still get their solo bits."""
    with _engine(model_dirs, "bf16", "auto") as engine:
        engine.model.plan_decode(engine.kv, whole_step=False)
        assert engine.model.plan.route == decode_plan.NATIVE_LAYERS
        kv = engine.new_cache()
        engine.prefill_into(kv, PROMPTS[0], 0)
        alone = [engine.model.forward(torch.tensor([t]), 9 + i, kv)[-1] for i, t in enumerate(DRAFTS[:3])]
        kv2 = engine.new_cache()
        engine.prefill_into(kv2, PROMPTS[0], 0)
        rows = engine.decode_rows(DRAFTS[:3], [9, 10, 11], [kv2] * 3)
        assert step_rows_calls == []
        for i, want in enumerate(alone):
            assert torch.equal(rows[i], want), i


def test_the_op_refuses_rows_it_cannot_serve(model_dirs):
    """Rows of one cache out of order, a cache index past the lists given, a position outside the
    cache: one clear error each, nothing computed."""
    with _engine(model_dirs, "bf16", "auto") as engine:
        a, step = engine.args, engine.decode_plan.step
        x = torch.zeros(2, a.hidden_size, dtype=torch.bfloat16)
        cos = torch.ones(2, a.head_dim, dtype=torch.bfloat16)

        def call(row_cache, positions, attention=step.attention):
            return native.decode_layers_rows(x, attention, row_cache, step.moe, cos, cos, positions, a.num_heads,
                                             a.num_kv_heads, a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob),
                                             step.inter)
        with pytest.raises(RuntimeError, match="increasing positions"):
            call([0, 0], [5, 4])
        with pytest.raises(RuntimeError, match="cache index"):
            call([0, 1], [5, 5])
        with pytest.raises(RuntimeError, match="outside its cache"):
            call([0, 0], [5, 64])
        with pytest.raises(RuntimeError, match="share a K/V tensor"):
            call([0, 1], [5, 5], step.attention + step.attention)
