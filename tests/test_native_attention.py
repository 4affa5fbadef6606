"""The native attention decode (engine/native/attention_decode.cpp): one call for a layer's attention
half of one token, against torch's ops on odd sizes, in the engine, and its fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from engine import native
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


def _torch_attention(x, norm_w, qkv_w, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, Nq, Nkv, o_w):
    """Transformer._attention's unfused steps for one token, on torch's ops (writes the caches)."""
    D = k_cache.shape[2]
    q, k, v = F.linear(_norm(x, norm_w), qkv_w).split([Nq * D, Nkv * D, Nkv * D], dim=1)
    q, k, v = (t.view(1, -1, D).transpose(0, 1) for t in (q, k, v))
    if q_norm is not None:
        q, k = _norm(q, q_norm), _norm(k, k_norm)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache[:, pos:pos + 1], v_cache[:, pos:pos + 1] = k, v
    out = F.scaled_dot_product_attention(q[None], k_cache[None, :, :pos + 1], v_cache[None, :, :pos + 1],
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


def test_bad_operands_are_refused():
    x, none = _rand(1, 64, seed=0), torch.empty(0, dtype=torch.bfloat16)
    cache = _rand(2, 8, 16, seed=1)
    with pytest.raises(RuntimeError, match="pos outside"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(128, 64, seed=3), none, none, _rand(1, 16, seed=4),
                                _rand(1, 16, seed=5), cache, cache.clone(), 8, 4, 2, _rand(64, 64, seed=6))
    with pytest.raises(RuntimeError, match="qkv_w"):
        native.attention_decode(x, _rand(64, seed=2), 1e-6, _rand(127, 64, seed=3), none, none, _rand(1, 16, seed=4),
                                _rand(1, 16, seed=5), cache, cache.clone(), 0, 4, 2, _rand(64, 64, seed=6))


def test_decode_runs_one_attention_call_per_layer_close_to_the_unfused_path(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=32)) as engine:
        model = engine.model
        model.step_loop = False  # per-layer calls (the whole step's: tests/test_native_moe.py)
        generate(engine, PROMPT, 1, Sampler())
        calls = count_calls(monkeypatch, "attention_decode")
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(calls) == 2 * engine.args.num_layers
        model._fused_attention = {layer: None for layer in range(engine.args.num_layers)}  # _attention's path
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]  # same KV rows rewritten
        assert len(calls) == 2 * engine.args.num_layers
    assert all(torch.allclose(f, s, rtol=0.02, atol=0.02) for f, s in zip(fused, apart))


@pytest.mark.parametrize("config", [dict(kv_dtype="int8"), dict(dtype="fp32")])
def test_what_it_does_not_cover_takes_the_unfused_path(bf16_model, monkeypatch, config):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32, **config)) as engine:
        calls, steps = count_calls(monkeypatch, "attention_decode"), count_calls(monkeypatch, "decode_layers")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert calls == [] and steps == []


def test_without_native_ops_attention_runs_on_torch(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        monkeypatch.setattr(native, "ready", False)  # as COLIBRI_NATIVE=0 or a CPU without avx512_bf16
        calls, steps = count_calls(monkeypatch, "attention_decode"), count_calls(monkeypatch, "decode_layers")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert calls == [] and steps == []
