"""The native attention decode with int8 / int4 projections (engine/native/attention_decode_int.cpp,
decode_step_int.cpp, engine/arch/attention_quant.py): its projections and K/V writes are the int
linear op's bits (the unfused path's), the whole step gives the per-layer calls' bits on int8 and
int4-g32 `--scope all` containers, the logits stay close to the unfused path, and where a condition
fails (native off, no VNNI/VBMI, int8 switched off, a bias, a layer shape it does not cover) the
existing path runs."""

import dataclasses

import pytest
import torch

from engine import native
from engine.arch import attention_quant
from engine.arch.kvquant import QuantizedRows
from engine.arch.layers import rms_norm
from engine.arch.rope import apply_rope
from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.weights.quantized import QuantWeight, quantize
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from test_streaming import budget_for_cache
from colibri_native_cases import (PROMPT, bf16_model, count_calls, int8_native_on,  # noqa: F401 (fixtures)
                                  needs_native_int, rand_bf16)

pytestmark = needs_native_int()
NONE = torch.empty(0, dtype=torch.bfloat16)


def _weights(quant, group, H, Nq, Nkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(Nq * D, H), (Nkv * D, H), (Nkv * D, H), (H, Nq * D)]
    return [QuantWeight.prepare(*quantize(torch.randn(*s, generator=g) * 0.1, quant, group or 64), quant, group or 64,
                                torch.bfloat16) for s in shapes]


def _rope_row(D, pos):
    angle = torch.arange(D // 2).float() * 0.37 * (pos + 1)
    return torch.cat([angle.cos()] * 2)[None].bfloat16(), torch.cat([angle.sin()] * 2)[None].bfloat16()


def _unfused_qkv(x, norm_w, mats, q_norm, k_norm, cos, sin, Nq, Nkv, D):
    """Transformer._attention's q/k/v steps for one token with QuantWeight projections (the int
    linear op each), per-head norms and rope: q, k [N, 1, D] after rope, v [Nkv, 1, D]."""
    normed = rms_norm(x, norm_w, 1e-6)
    q, k, v = (m.linear(normed).view(1, -1, D).transpose(0, 1) for m in mats[:3])
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, 1e-6), rms_norm(k, k_norm, 1e-6)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _call(x, norm_w, mats, group, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv, **scales):
    proj = [t for m in mats for t in (m.qweight, m.qscale)]
    return native.attention_decode_int(x, norm_w, 1e-6, proj, group, NONE if q_norm is None else q_norm,
                                       NONE if k_norm is None else k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv,
                                       **scales)


# int8 with a ragged H; int4 g32 with k/v of 32 rows (all in the partial-block tail) and q of 96
# (one full 64-row block and a tail); int4 g64 / g128 with full blocks.
CASES = [("int8", 0, 100, 6, 3, 24, True), ("int8", 0, 64, 4, 4, 16, False), ("int4", 32, 64, 6, 2, 16, True),
         ("int4", 64, 128, 8, 2, 32, False), ("int4", 128, 256, 4, 2, 64, True)]


@pytest.mark.parametrize("quant,group,H,Nq,Nkv,D,head_norm", CASES)
def test_at_the_first_position_the_op_is_the_unfused_path_bit_for_bit(quant, group, H, Nq, Nkv, D, head_norm):
    """pos 0 attends one row: the attention output is that row's v exactly (softmax of one score is 1),
    so q/k/v, the K/V rows written and o_proj are all the unfused int path's bits."""
    mats = _weights(quant, group, H, Nq, Nkv, D, seed=H + D)
    x, norm_w = rand_bf16(1, H, seed=1), rand_bf16(H, seed=2).abs() + 0.5
    q_norm, k_norm = (rand_bf16(D, seed=3).abs() + 0.5, rand_bf16(D, seed=4).abs() + 0.5) if head_norm else (None, None)
    cos, sin = _rope_row(D, 0)
    k_cache, v_cache = torch.zeros(Nkv, 8, D, dtype=torch.bfloat16), torch.zeros(Nkv, 8, D, dtype=torch.bfloat16)
    y = _call(x, norm_w, mats, group, q_norm, k_norm, cos, sin, k_cache, v_cache, 0, Nq, Nkv)
    _, k, v = _unfused_qkv(x, norm_w, mats, q_norm, k_norm, cos, sin, Nq, Nkv, D)
    assert torch.equal(k_cache[:, 0], k[:, 0]) and torch.equal(v_cache[:, 0], v[:, 0])
    assert not bool(k_cache[:, 1:].any()) and not bool(v_cache[:, 1:].any())  # only this position's rows
    attn = v[:, 0].repeat_interleave(Nq // Nkv, dim=0).reshape(1, Nq * D)  # each query head's K/V head's row
    assert torch.equal(y, x + mats[3].linear(attn))


@pytest.mark.parametrize("quant,group,H,Nq,Nkv,D,head_norm", CASES[::2])
def test_later_positions_write_the_unfused_rows_and_attend_close_to_sdpa(quant, group, H, Nq, Nkv, D, head_norm):
    mats = _weights(quant, group, H, Nq, Nkv, D, seed=7)
    ctx, pos = 80, 70  # more than one 64-row block of the heads loop
    x, norm_w = rand_bf16(1, H, seed=11), rand_bf16(H, seed=12).abs() + 0.5
    q_norm, k_norm = (rand_bf16(D, seed=13).abs() + 0.5, rand_bf16(D, seed=14).abs() + 0.5) if head_norm else (None, None)
    cos, sin = _rope_row(D, pos)
    k_cache, v_cache = rand_bf16(Nkv, ctx, D, seed=15), rand_bf16(Nkv, ctx, D, seed=16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    y = _call(x, norm_w, mats, group, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv)
    q, k, v = _unfused_qkv(x, norm_w, mats, q_norm, k_norm, cos, sin, Nq, Nkv, D)
    k_ref[:, pos:pos + 1], v_ref[:, pos:pos + 1] = k, v
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k_ref[:, :pos + 1][None], v_ref[:, :pos + 1][None],
                                                           enable_gqa=Nq != Nkv)
    ref = x + mats[3].linear(out[0].transpose(0, 1).reshape(1, Nq * D))
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32)])
def test_a_quantized_cache_gets_quantized_rows_codes_of_the_unfused_rows(kind, quant, group):
    H, Nq, Nkv, D, ctx = 64, 4, 2, 16, 8
    mats = _weights(quant, group, H, Nq, Nkv, D, seed=3)
    x, norm_w = rand_bf16(1, H, seed=21), rand_bf16(H, seed=22).abs() + 0.5
    q_norm, k_norm = rand_bf16(D, seed=23).abs() + 0.5, rand_bf16(D, seed=24).abs() + 0.5
    k_cache, v_cache = (QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16) for _ in range(2))
    k_ref, v_ref = (QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16) for _ in range(2))
    for pos in (0, 3, 7):
        cos, sin = _rope_row(D, pos)
        _call(x, norm_w, mats, group, q_norm, k_norm, cos, sin, k_cache.codes, v_cache.codes, pos, Nq, Nkv,
              k_scales=k_cache.scales, v_scales=v_cache.scales)
        _, k, v = _unfused_qkv(x, norm_w, mats, q_norm, k_norm, cos, sin, Nq, Nkv, D)
        k_ref[:, pos:pos + 1], v_ref[:, pos:pos + 1] = k, v
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
        assert torch.equal(got.scales, want.scales)


def test_bad_operands_are_refused():
    mats = _weights("int8", 0, 64, 4, 2, 16, seed=1)
    x, norm_w = rand_bf16(1, 64, seed=0), rand_bf16(64, seed=2)
    cos, sin = _rope_row(16, 0)
    cache = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q must be"):  # k in q's place
        _call(x, norm_w, [mats[1], mats[1], mats[2], mats[3]], 0, None, None, cos, sin, cache, cache.clone(), 0, 4, 2)
    with pytest.raises(RuntimeError, match="pos outside"):
        _call(x, norm_w, mats, 0, None, None, cos, sin, cache, cache.clone(), 8, 4, 2)
    with pytest.raises(RuntimeError, match="int4 weights must be uint8"):  # int8 codes read as int4
        _call(x, norm_w, mats, 32, None, None, cos, sin, cache, cache.clone(), 0, 4, 2)
    with pytest.raises(RuntimeError, match="8 tensors"):
        native.attention_decode_int(x, norm_w, 1e-6, [mats[0].qweight], 0, NONE, NONE, cos, sin, cache, cache.clone(),
                                    0, 4, 2)


# --- in the engine: tiny `--scope all` containers ------------------------------------------------

@pytest.fixture(scope="module")
def scope_all(bf16_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("scope_all")
    return {(q, g): convert(bf16_model, root / f"{q}{g}", q, group_size=g or 64, scope="all")["path"]
            for q, g in (("int8", 0), ("int4", 32))}


KINDS = [("int8", 0), ("int4", 32)]


def _unfused_attention(model, kv):
    model.plan_decode(kv, whole_step=False, native_attention=False)  # _attention's path (and no whole step)


@pytest.mark.parametrize("quant,group", KINDS)
def test_every_layer_takes_the_int_op_close_to_the_unfused_path(scope_all, quant, group, monkeypatch):
    with Engine(scope_all[quant, group], EngineConfig(threads=2, ctx_size=32)) as engine:
        model, layers = engine.model, engine.args.num_layers
        assert isinstance(model.w["model.layers.0.self_attn.q_proj.weight"], QuantWeight)
        model.plan_decode(engine.kv, whole_step=False)
        generate(engine, PROMPT, 1, Sampler())
        calls = count_calls(monkeypatch, "attention_decode_int")
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(calls) == 2 * layers
        assert all(type(entry.operands) is attention_quant.QuantAttention and entry.operands.group == group
                   for entry in model.plan.attention)
        rows = [c[0][:, len(PROMPT) + 1].clone() for c in (engine.kv.k, engine.kv.v)]  # layer 0's, last token
        _unfused_attention(model, engine.kv)
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]  # same positions rewritten
        assert len(calls) == 2 * layers
        # layer 0 sees the same input either way: its K/V rows are the same bits
        assert all(torch.equal(r, c[0][:, len(PROMPT) + 1]) for r, c in zip(rows, (engine.kv.k, engine.kv.v)))
    assert all(torch.allclose(f, s, rtol=0.02, atol=0.02) for f, s in zip(fused, apart))


@pytest.mark.parametrize("kv_dtype,threads", [("bf16", 2), ("int8", 2), ("bf16", 1)])
@pytest.mark.parametrize("quant,group", KINDS)
def test_the_whole_step_gives_the_per_layer_bits_in_one_call(scope_all, quant, group, kv_dtype, threads, monkeypatch):
    config = EngineConfig(threads=threads, ctx_size=32, **({} if kv_dtype == "bf16" else {"kv_dtype": kv_dtype}))
    with Engine(scope_all[quant, group], config) as engine:
        model, layers = engine.model, engine.args.num_layers
        steps = count_calls(monkeypatch, "decode_layers_int")
        per_layer = count_calls(monkeypatch, "attention_decode_int")
        whole_tokens = generate(engine, PROMPT, 5, Sampler()).output_ids
        assert len(steps) == 4 and per_layer == []
        whole = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        caches = [t.clone() for t in _cache_tensors(engine.kv)]
        model.plan_decode(engine.kv, whole_step=False)
        layer_tokens = generate(engine, PROMPT, 5, Sampler()).output_ids
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(steps) == 6 and len(per_layer) == 6 * layers
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(caches, _cache_tensors(engine.kv)))
    assert whole_tokens == layer_tokens and all(torch.equal(w, a) for w, a in zip(whole, apart))


def _cache_tensors(kv):
    out = []
    for rows in kv.k + kv.v:
        out += [rows.codes, rows.scales] if isinstance(rows, QuantizedRows) else [rows]
    return out


def test_without_native_ops_or_vnni_the_existing_path_runs(scope_all, monkeypatch):
    path = scope_all["int8", 0]
    ops = ["attention_decode_int", "decode_layers_int", "attention_decode", "decode_layers"]
    with Engine(path, EngineConfig(threads=1, ctx_size=32)) as engine:
        reference = generate(engine, PROMPT, 3, Sampler()).output_ids
        monkeypatch.setattr(native, "ready", False)  # as COLIBRI_NATIVE=0
        assert engine.model.plan_decode(engine.kv).route == "reference"  # (the route is chosen at load)
        counts = [count_calls(monkeypatch, name) for name in ops]
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == len(reference)
        assert counts == [[]] * 4
    monkeypatch.setattr(native, "ready", True)
    monkeypatch.setattr(native, "int_ready", False)  # a CPU without VNNI / VBMI (INT_FLAGS)
    with Engine(path, EngineConfig(threads=1, ctx_size=32)) as engine:
        counts = [count_calls(monkeypatch, name) for name in ops]
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert counts == [[]] * 4 and set(engine.model.plan.attention) == {None}
    monkeypatch.setattr(native, "int_ready", True)
    monkeypatch.setattr(native, "int8_decode", False)  # COLIBRI_NATIVE_INT8=0: torch's int8 kernel
    with Engine(path, EngineConfig(threads=1, ctx_size=32)) as engine:
        counts = [count_calls(monkeypatch, name) for name in ops]
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert counts == [[]] * 4


def test_a_layer_with_a_bias_keeps_the_unfused_attention_and_the_step_its_layers(scope_all, monkeypatch):
    with Engine(scope_all["int4", 32], EngineConfig(threads=1, ctx_size=32)) as engine:
        w, layers = engine.model.w, engine.args.num_layers
        w["model.layers.1.self_attn.v_proj.bias"] = torch.zeros(engine.args.num_kv_heads * engine.args.head_dim,
                                                                dtype=torch.bfloat16)
        engine.model.plan_decode(engine.kv)  # (a weight changed after load: the route is decided again)
        steps, calls = count_calls(monkeypatch, "decode_layers_int"), count_calls(monkeypatch, "attention_decode_int")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert steps == [] and len(calls) == 2 * (layers - 1)
        assert engine.model.plan.attention[1] is None


def test_layers_it_does_not_cover_are_refused(scope_all):
    with Engine(scope_all["int8", 0], EngineConfig(threads=1, ctx_size=32)) as engine:
        a, w = engine.args, dict(engine.model.w)
    assert attention_quant.layer_operands(a, w, 0) is not None
    for changes in ({"qk_norm": "full"}, {"clip_qkv": 8.0}, {"rotary_dim": a.head_dim // 2}):
        assert attention_quant.layer_operands(dataclasses.replace(a, **changes), w, 0) is None
    mixed = dict(w)  # q/k/v/o of two kinds
    q = mixed["model.layers.0.self_attn.q_proj.weight"]
    mixed["model.layers.0.self_attn.q_proj.weight"] = QuantWeight.prepare(
        *quantize(q.dequantize(), "int4", 32), "int4", 32, torch.bfloat16)
    assert attention_quant.layer_operands(a, mixed, 0) is None
    plain = dict(w)  # bf16 projections: the bf16 op's (fused q/k/v at load)
    plain["model.layers.0.self_attn.o_proj.weight"] = w["model.layers.0.self_attn.o_proj.weight"].dequantize().bfloat16()
    assert attention_quant.layer_operands(a, plain, 0) is None


@pytest.mark.parametrize("placement", [dict(io_mode="direct", prefetch_depth=0, cpu_cache_ratio=0.0),
                                       dict(io_mode="buffered", prefetch_depth=1, cpu_cache_ratio=1.0,
                                            cache_policy="lfu")])
def test_streaming_experts_keep_the_resident_tokens(scope_all, placement, monkeypatch):
    """Streamed experts run the per-layer int attention and the unfused MoE, the resident run the
    whole int step: the same tokens (placement never changes them)."""
    path = scope_all["int4", 32]
    with Engine(path, EngineConfig(threads=2, ctx_size=32)) as engine:
        assert not engine.plan.streaming
        reference = generate(engine, PROMPT, 8, Sampler()).output_ids
    config = EngineConfig(threads=2, ctx_size=32, io_threads=2, **placement)
    config = config.replace(ram_budget=budget_for_cache(path, config, cache_experts=3))
    with Engine(path, config) as engine:
        assert engine.plan.streaming
        calls = count_calls(monkeypatch, "attention_decode_int")
        tokens = generate(engine, PROMPT, 8, Sampler()).output_ids
    assert tokens == reference and len(calls) == 7 * engine.args.num_layers
