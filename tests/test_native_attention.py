"""The native attention decode (engine/native/attention_decode.cpp): one call for a layer's attention
half of one token, against torch's ops on odd sizes, in the engine, and its fallbacks; with a bf16
cache and with a quantized one (kv_dtype int8 / fp8: QuantizedRows' codes and scales)."""

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.arch.kvquant import QuantizedRows
from engine.arch.rope import apply_rope
from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_requirements import needs
from colibri_native_cases import PROMPT, bf16_model, count_calls, rand_bf16  # noqa: F401 (bf16_model: a fixture)

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))
_rand = rand_bf16


def _norm(x, w, eps=1e-6):  # layers.rms_norm on torch's ops
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _torch_attention(x, norm_w, qkv_w, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv, o_w, qkv_b=None):
    """Transformer._attention's unfused steps for one token, on torch's ops (writes the caches);
    cos/sin narrower than a head: partial rotary, as apply_rope does it."""
    D = k_cache.shape[2]
    q, k, v = F.linear(_norm(x, norm_w), qkv_w, qkv_b).split([Nq * D, Nkv * D, Nkv * D], dim=1)
    q, k, v = (t.view(1, -1, D).transpose(0, 1) for t in (q, k, v))
    if q_norm is not None:
        q, k = _norm(q, q_norm), _norm(k, k_norm)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[:, pos:pos + 1], v_cache[:, pos:pos + 1] = k, v  # (QuantizedRows: quantizes; reads dequantize)
    out = F.scaled_dot_product_attention(q[None], k_cache[:, :pos + 1][None], v_cache[:, :pos + 1][None],
                                         enable_gqa=Nq != Nkv)
    return x + F.linear(out[0].transpose(0, 1).reshape(1, Nq * D), o_w)


@pytest.mark.parametrize("H,Nq,Nkv,D,pos,head_norm", [(100, 6, 3, 24, 0, True), (64, 4, 4, 16, 5, False),
                                                       (128, 8, 2, 64, 9, True)])
def test_attention_decode_matches_torchs_ops(H, Nq, Nkv, D, pos, head_norm):
    ctx = 12
    x, norm_w = _rand(1, H, seed=1), _rand(H, seed=2).abs() + 0.5
    qkv_w, o_w = _rand((Nq + 2 * Nkv) * D, H, seed=3, scale=0.1), _rand(H, Nq * D, seed=4, scale=0.1)
    q_norm, k_norm = (_rand(D, seed=5).abs() + 0.5, _rand(D, seed=6).abs() + 0.5) if head_norm else (None, None)
    angle = torch.arange(D // 2).float() * 0.37 * (pos + 1)
    cos, sin = torch.cat([angle.cos()] * 2)[None].bfloat16(), torch.cat([angle.sin()] * 2)[None].bfloat16()
    k_cache, v_cache = _rand(Nkv, ctx, D, seed=7), _rand(Nkv, ctx, D, seed=8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = _torch_attention(x, norm_w, qkv_w, q_norm, k_norm, cos, sin, k_ref, v_ref, pos, Nq, Nkv, o_w)
    none = torch.empty(0, dtype=torch.bfloat16)
    y = native.attention_decode(x, norm_w, 1e-6, qkv_w, none if q_norm is None else q_norm,
                                none if k_norm is None else k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv, o_w)
    assert y.shape == (1, H) and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -6, atol=2e-2)
    assert torch.allclose(k_cache.float(), k_ref.float(), rtol=2 ** -6, atol=1e-2)  # this position's rows written
    assert torch.allclose(v_cache.float(), v_ref.float(), rtol=2 ** -6, atol=1e-2)
    untouched = [p for p in range(ctx) if p != pos]
    assert torch.equal(k_cache[:, untouched], _rand(Nkv, ctx, D, seed=7)[:, untouched])


@pytest.mark.parametrize("rot", [8, 16, 32])  # a quarter, half (glm4_moe's 0.5) and all of a head of 32
def test_attention_decode_with_biases_and_partial_rotary_matches_torchs_ops(rot):
    """glm4_moe and qwen2_moe's attention: q/k/v biases (added before the projection's rounding, as
    addmm adds them) and rope over the first `rot` dims of each head only; in one call and in the
    rows op, which gives each row the one-row call's bits."""
    H, Nq, Nkv, D, pos, ctx = 96, 4, 2, 32, 6, 10
    x, norm_w = _rand(1, H, seed=1), _rand(H, seed=2).abs() + 0.5
    qkv_w, o_w = _rand((Nq + 2 * Nkv) * D, H, seed=3, scale=0.1), _rand(H, Nq * D, seed=4, scale=0.1)
    qkv_b = _rand((Nq + 2 * Nkv) * D, seed=9)
    q_norm, k_norm = _rand(D, seed=5).abs() + 0.5, _rand(D, seed=6).abs() + 0.5
    angle = torch.arange(rot // 2).float() * 0.41 * (pos + 1)
    cos, sin = torch.cat([angle.cos()] * 2)[None].bfloat16(), torch.cat([angle.sin()] * 2)[None].bfloat16()
    k_cache, v_cache = _rand(Nkv, ctx, D, seed=7), _rand(Nkv, ctx, D, seed=8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = _torch_attention(x, norm_w, qkv_w, q_norm, k_norm, cos, sin, k_ref, v_ref, pos, Nq, Nkv, o_w, qkv_b)
    y = native.attention_decode(x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv,
                                o_w, qkv_b=qkv_b, rot=0 if rot == D else rot)
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -6, atol=2e-2)
    assert torch.allclose(k_cache.float(), k_ref.float(), rtol=2 ** -6, atol=1e-2)
    unbiased = native.attention_decode(x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin, k_cache.clone(),
                                       v_cache.clone(), pos, Nq, Nkv, o_w, rot=0 if rot == D else rot)
    assert not torch.allclose(unbiased.float(), ref.float(), rtol=2 ** -6, atol=2e-2)  # the bias is not lost
    # Three rows of one cache at consecutive positions (a verify): row r is the one-row call's bits.
    xs = torch.cat([x, _rand(2, H, seed=11)])
    coss, sins = torch.cat([cos, cos.roll(1, 1), cos.roll(2, 1)]), torch.cat([sin, sin.roll(1, 1), sin.roll(2, 1)])
    k_rows, v_rows = _rand(Nkv, ctx, D, seed=7), _rand(Nkv, ctx, D, seed=8)
    rows = native.attention_decode_rows(xs, norm_w, 1e-6, qkv_w, q_norm, k_norm, coss, sins, [k_rows] * 3,
                                        [v_rows] * 3, [pos, pos + 1, pos + 2], Nq, Nkv, o_w, qkv_b=qkv_b,
                                        rot=0 if rot == D else rot)
    k_one, v_one = _rand(Nkv, ctx, D, seed=7), _rand(Nkv, ctx, D, seed=8)
    for r in range(3):
        alone = native.attention_decode(xs[r:r + 1], norm_w, 1e-6, qkv_w, q_norm, k_norm, coss[r:r + 1],
                                        sins[r:r + 1], k_one, v_one, pos + r, Nq, Nkv, o_w, qkv_b=qkv_b,
                                        rot=0 if rot == D else rot)
        assert torch.equal(rows[r:r + 1], alone), r
    assert torch.equal(k_rows, k_one) and torch.equal(v_rows, v_one)


def test_bad_operands_are_refused():
    x, none = _rand(1, 64, seed=0), torch.empty(0, dtype=torch.bfloat16)
    cache = _rand(2, 8, 16, seed=1)
    with pytest.raises(RuntimeError, match="pos outside"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(128, 64, seed=3), none, none, _rand(1, 16, seed=4),
                                _rand(1, 16, seed=5), cache, cache.clone(), 8, 4, 2, _rand(64, 64, seed=6))
    with pytest.raises(RuntimeError, match="qkv_w"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(127, 64, seed=3), none, none, _rand(1, 16, seed=4),
                                _rand(1, 16, seed=5), cache, cache.clone(), 0, 4, 2, _rand(64, 64, seed=6))
    with pytest.raises(RuntimeError, match="qkv_b"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(128, 64, seed=3), none, none, _rand(1, 16, seed=4),
                                _rand(1, 16, seed=5), cache, cache.clone(), 0, 4, 2, _rand(64, 64, seed=6),
                                qkv_b=_rand(127, seed=7))
    with pytest.raises(RuntimeError, match="rot"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(128, 64, seed=3), none, none, _rand(1, 7, seed=4),
                                _rand(1, 7, seed=5), cache, cache.clone(), 0, 4, 2, _rand(64, 64, seed=6), rot=7)


def test_decode_runs_one_attention_call_per_layer_close_to_the_unfused_path(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=32)) as engine:
        model = engine.model
        model.plan_decode(engine.kv, whole_step=False)  # per-layer calls (the whole step's: tests/test_native_moe.py)
        generate(engine, PROMPT, 1, Sampler())
        calls = count_calls(monkeypatch, "attention_decode")
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(calls) == 2 * engine.args.num_layers
        model.plan_decode(engine.kv, whole_step=False, native_attention=False)  # _attention's path
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]  # same KV rows rewritten
        assert len(calls) == 2 * engine.args.num_layers
    assert all(torch.allclose(f, s, rtol=0.02, atol=0.02) for f, s in zip(fused, apart))


def test_what_it_does_not_cover_takes_the_unfused_path(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32, dtype="fp32")) as engine:
        calls, steps = count_calls(monkeypatch, "attention_decode"), count_calls(monkeypatch, "decode_layers")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert calls == [] and steps == []


def test_without_native_ops_attention_runs_on_torch(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        monkeypatch.setattr(native, "ready", False)  # as COLIBRI_NATIVE=0 or a CPU without avx512_bf16
        assert engine.model.plan_decode(engine.kv).route == "reference"  # (the route is chosen at load)
        calls, steps = count_calls(monkeypatch, "attention_decode"), count_calls(monkeypatch, "decode_layers")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert calls == [] and steps == []


# --- a quantized cache (kv_dtype int8 / fp8) --------------------------------------------------

def _operands(H, Nq, Nkv, D, seed=0, head_norm=True):
    x, norm_w = _rand(1, H, seed=seed + 1), _rand(H, seed=seed + 2).abs() + 0.5
    qkv_w, o_w = _rand((Nq + 2 * Nkv) * D, H, seed=seed + 3, scale=0.1), _rand(H, Nq * D, seed=seed + 4, scale=0.1)
    none = torch.empty(0, dtype=torch.bfloat16)
    q_norm, k_norm = (_rand(D, seed=seed + 5).abs() + 0.5, _rand(D, seed=seed + 6).abs() + 0.5) if head_norm \
        else (none, none)
    return x, norm_w, qkv_w, q_norm, k_norm, o_w


def _rope_row(D, pos):
    angle = torch.arange(D // 2).float() * 0.37 * (pos + 1)
    return torch.cat([angle.cos()] * 2)[None].bfloat16(), torch.cat([angle.sin()] * 2)[None].bfloat16()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("H,Nq,Nkv,D,head_norm", [(100, 6, 3, 18, False), (64, 4, 2, 40, True)])
def test_the_quantized_cache_write_gives_quantized_rows_codes_and_scales(kind, H, Nq, Nkv, D, head_norm):
    """The op's codes and scales for the rows it writes equal QuantizedRows.__setitem__'s for the same
    bf16 rows (the op's own K/V rows, read off a bf16 cache run of the same inputs): head sizes with a
    tail past 16 lanes, several positions, an all-zero row (K/V head 0) and outliers (head 1)."""
    ctx, positions = 8, [0, 1, 4, 7]
    x, norm_w, qkv_w, q_norm, k_norm, o_w = _operands(H, Nq, Nkv, D, head_norm=head_norm)
    Q, KV = Nq * D, Nkv * D
    qkv_w[Q:Q + D] = 0  # K/V head 0's rows: all zero (norm and rope keep zero zero)
    qkv_w[Q + KV:Q + KV + D] = 0
    qkv_w[Q + D + 3] *= 300  # one outlier per row of head 1's keys and values: the rest sit near code 0
    qkv_w[Q + KV + D + 5] *= 300
    bf16_k, bf16_v = torch.zeros(Nkv, ctx, D, dtype=torch.bfloat16), torch.zeros(Nkv, ctx, D, dtype=torch.bfloat16)
    quant_k, quant_v = (QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16) for _ in range(2))
    ref_k, ref_v = (QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16) for _ in range(2))
    for pos in positions:
        cos, sin = _rope_row(D, pos)
        args = (x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin)
        native.attention_decode(*args, bf16_k, bf16_v, pos, Nq, Nkv, o_w)
        native.attention_decode(*args, quant_k.codes, quant_v.codes, pos, Nq, Nkv, o_w, quant_k.scales, quant_v.scales)
        ref_k[:, pos:pos + 1], ref_v[:, pos:pos + 1] = bf16_k[:, pos:pos + 1], bf16_v[:, pos:pos + 1]
    outliers = bf16_k[1, positions].abs()
    assert bool((bf16_k[0] == 0).all()) and bool((outliers.amax(-1) > 20 * outliers.median(-1).values).all())
    for got, want in ((quant_k, ref_k), (quant_v, ref_v)):
        assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))  # bits, e4m3 -0 included
        assert torch.equal(got.scales, want.scales)
    assert bool((quant_k.codes[1, positions].float() != 0).sum(-1).ge(2).all())  # outlier rows keep small codes too
    assert torch.equal(quant_k[0, positions], torch.zeros(len(positions), D, dtype=torch.bfloat16))


def _random_codes(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "int8":
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes: every finite e4m3 value, subnormals included
    return codes.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("H,Nq,Nkv,D,pos,head_norm", [(100, 6, 3, 24, 0, True), (128, 8, 2, 64, 70, True),
                                                       (64, 4, 4, 18, 9, False)])
def test_the_quantized_cache_read_matches_torchs_ops_on_dequantized_rows(kind, H, Nq, Nkv, D, pos, head_norm):
    """Against the unfused steps on a QuantizedRows cache (SDPA over its dequantized bf16 rows), with
    cached rows of random codes and scales, within the bf16 fused attention's own tolerance."""
    ctx = 80  # pos 70: more than one 64-row block of the heads loop
    x, norm_w, qkv_w, q_norm, k_norm, o_w = _operands(H, Nq, Nkv, D, head_norm=head_norm)
    cos, sin = _rope_row(D, pos)
    caches = []
    for seed in (7, 8):
        rows = QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16)
        rows.codes.copy_(_random_codes(kind, (Nkv, ctx, D), seed))
        rows.scales.copy_(torch.rand(Nkv, ctx, generator=torch.Generator().manual_seed(seed)) * 0.02 + 0.002)
        caches.append(rows)
    k_cache, v_cache = caches
    k_ref, v_ref = (QuantizedRows((Nkv, ctx, D), kind, torch.bfloat16) for _ in range(2))
    for ref, rows in ((k_ref, k_cache), (v_ref, v_cache)):
        ref.codes.copy_(rows.codes), ref.scales.copy_(rows.scales)
    ref = _torch_attention(x, norm_w, qkv_w, q_norm if head_norm else None, k_norm if head_norm else None, cos, sin,
                           k_ref, v_ref, pos, Nq, Nkv, o_w)
    y = native.attention_decode(x, norm_w, 1e-6, qkv_w, q_norm, k_norm, cos, sin, k_cache.codes, v_cache.codes, pos,
                                Nq, Nkv, o_w, k_cache.scales, v_cache.scales)
    assert torch.allclose(y.float(), ref.float(), rtol=2 ** -6, atol=2e-2)
    assert torch.allclose(k_cache[:, pos].float(), k_ref[:, pos].float(), rtol=0.05, atol=2e-2)  # this row written
    untouched = [p for p in range(ctx) if p != pos]
    assert torch.equal(k_cache.codes[:, untouched].view(torch.uint8), k_ref.codes[:, untouched].view(torch.uint8))
    assert torch.equal(v_cache.scales[:, untouched], v_ref.scales[:, untouched])


def test_bad_quantized_operands_are_refused():
    x, none = _rand(1, 64, seed=0), torch.empty(0, dtype=torch.bfloat16)
    codes = torch.zeros(2, 8, 16, dtype=torch.int8)
    args = (x, _rand(64, seed=2), 1e-6, _rand(128, 64, seed=3), none, none, _rand(1, 16, seed=4), _rand(1, 16, seed=5))
    with pytest.raises(RuntimeError, match="scales must be a contiguous fp32"):  # codes without their scales
        native.attention_decode(*args, codes, codes.clone(), 0, 4, 2, _rand(64, 64, seed=6))
    with pytest.raises(RuntimeError, match="scales must be a contiguous fp32"):
        native.attention_decode(*args, codes, codes.clone(), 0, 4, 2, _rand(64, 64, seed=6), torch.zeros(2, 7),
                                torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="both of one dtype"):
        native.attention_decode(*args, codes, _rand(2, 8, 16, seed=1), 0, 4, 2, _rand(64, 64, seed=6),
                                torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="a bf16 cache has no scales"):
        native.attention_decode(*args, _rand(2, 8, 16, seed=1), _rand(2, 8, 16, seed=2), 0, 4, 2,
                                _rand(64, 64, seed=6), torch.zeros(2, 8), torch.zeros(2, 8))


def _unfused(model, kv):
    model.plan_decode(kv, whole_step=False, native_attention=False)  # _attention's path (and no whole step)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_cache_decodes_fused_close_to_the_unfused_path(bf16_model, monkeypatch, kind):
    """Per-layer fused calls with kv_dtype int8 / fp8: logits close to the unfused path's (which
    quantizes and dequantizes through QuantizedRows) and the same greedy tokens."""
    layers = None
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=48, kv_dtype=kind)) as engine:
        model, layers = engine.model, engine.args.num_layers
        assert isinstance(engine.kv.k[0], QuantizedRows) and engine.kv.k[0].kind == kind
        model.plan_decode(engine.kv, whole_step=False)
        calls = count_calls(monkeypatch, "attention_decode")
        fused_tokens = generate(engine, PROMPT, 12, Sampler()).output_ids
        assert len(calls) == 11 * layers  # every decode token (the prefill runs unfused), every layer
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        _unfused(model, engine.kv)
        apart_tokens = generate(engine, PROMPT, 12, Sampler()).output_ids
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(calls) == 11 * layers + 2 * layers
    assert fused_tokens == apart_tokens
    assert all(torch.allclose(f, s, rtol=0.02, atol=0.02) for f, s in zip(fused, apart))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_cache_takes_the_whole_step_call_with_the_per_layer_bits(bf16_model, monkeypatch, kind):
    """decode_layers_bf16 runs with the quantized cache (its operands hold the codes and scales) and
    gives the bits of the per-layer calls, cache included."""
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=48, kv_dtype=kind)) as engine:
        model = engine.model
        steps, calls = count_calls(monkeypatch, "decode_layers"), count_calls(monkeypatch, "attention_decode")
        whole = generate(engine, PROMPT, 6, Sampler()).output_ids
        assert len(steps) == 5 and calls == []
        step = model.plan.step
        assert step is not None and step.attention[5] is engine.kv.k[0].codes and step.attention[7] is engine.kv.k[0].scales
        step_logits = engine.forward([11], len(PROMPT))
        codes, scales = engine.kv.k[1].codes.clone(), engine.kv.v[1].scales.clone()
        model.plan_decode(engine.kv, whole_step=False)
        per_layer = generate(engine, PROMPT, 6, Sampler()).output_ids
        assert len(steps) == 6 and len(calls) == 5 * engine.args.num_layers
        layer_logits = engine.forward([11], len(PROMPT))
        assert torch.equal(engine.kv.k[1].codes.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(engine.kv.v[1].scales, scales)
    assert whole == per_layer and torch.equal(step_logits, layer_logits)
