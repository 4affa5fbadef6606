"""The fused MoE decode layer (engine/native/moe_decode.cpp, engine/arch/moe.ResidentMoeLayer): its
pieces against torch references, the fused call bit-equal to the pieces called apart (what the
streaming path runs), resident decode taking it, and the fallbacks where it does not apply."""

import pytest
import torch
import torch.nn.functional as F

from engine import native, synth
from engine.arch import moe
from engine.arch.args import ModelArgs
from engine.arch.layers import rms_norm, route
from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_requirements import needs
from colibri_native_cases import PROMPT, bf16_model, count_calls, rand_bf16  # noqa: F401 (bf16_model: a fixture)

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))
_rand = rand_bf16


@pytest.mark.parametrize("shape", [(1, 100), (5, 1, 31), (1, 1024)])  # a token, per-head rows, ragged H
def test_rms_norm_is_torchs_within_a_rounding(shape):
    x, w = _rand(*shape, seed=1), _rand(shape[-1], seed=2)
    y = native.rms_norm(x, w, 1e-6)
    ref = w.float() * F.rms_norm(x.float(), (shape[-1],), eps=1e-6)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert bool(((y.float() - ref).abs() <= ref.abs() * 2 ** -6 + 1e-6).all())
    # and layers.rms_norm takes it for one token (x [..., 1, H]), torch's op for several
    assert torch.equal(rms_norm(x, w, 1e-6), y)
    several = torch.cat([x, x], dim=-2)
    assert torch.equal(rms_norm(several, w, 1e-6), w * F.rms_norm(several.float(), (shape[-1],), eps=1e-6).bfloat16())


@pytest.mark.parametrize("E,k,norm", [(37, 3, True), (64, 8, True), (16, 1, False), (8, 8, False)])
def test_route_topk_picks_torchs_experts(E, k, norm):
    x, w = _rand(1, 96, seed=E), _rand(E, 96, seed=k)
    ids, weights = native.route_topk(x, w, k, norm)
    probs = torch.softmax(native.linear(x, w).float(), dim=-1)[0]  # the router's bf16 logits (linear_bf16)
    ref_ids = sorted(range(E), key=lambda e: (-float(probs[e]), e))[:k]  # descending weight; ties: the lower id
    ref_w = probs[ref_ids][None]
    if norm:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and ids.shape == (1, k) and weights.dtype == torch.bfloat16
    assert ids.tolist() == [ref_ids]
    assert torch.allclose(weights.float(), ref_w, rtol=2 ** -7, atol=1e-6)
    args = ModelArgs("qwen3_moe", 300, 96, 1, 4, 2, 24, 128, 1e-6, {}, 512, num_experts=E, top_k=k, norm_topk_prob=norm)
    assert all(torch.equal(a, b) for a, b in zip(route(args, w, x), (ids, weights)))  # layers.route: the same op


def test_route_topk_breaks_ties_by_the_lower_id():
    x = _rand(1, 32, seed=0)
    w = _rand(1, 32, seed=1).repeat(6, 1)  # six equal logits
    assert native.route_topk(x, w, 3, True)[0].tolist() == [[0, 1, 2]]


def test_combine_is_the_weighted_sum():
    ys, weights = _rand(5, 77, seed=3), _rand(5, seed=4).abs()
    y = native.combine(ys, weights)
    ref = weights.float() @ ys.float()
    assert y.shape == (1, 77) and bool(((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-4).all())


def _experts(n: int, hidden: int, inter: int, fused: bool, seed: int = 0) -> list[tuple]:
    out = []
    for e in range(n):
        gate_up = _rand(2 * inter, hidden, seed=seed + 2 * e, scale=0.2)
        down = _rand(hidden, inter, seed=seed + 2 * e + 1, scale=0.2)
        out.append((gate_up, down) if fused else (gate_up[:inter].clone(), gate_up[inter:].clone(), down))
    return out


def _apart(layer: moe.ResidentMoeLayer, experts: list[tuple], h: torch.Tensor) -> torch.Tensor:
    """The layer as the unfused decode path computes it with native ops loaded: norm, route, experts
    one at a time (streaming) in ascending id order, combine, residual add."""
    normed = native.rms_norm(h, layer.norm_w, layer.eps)
    ids, weights = native.route_topk(normed, layer.router_w, layer.top_k, layer.norm_topk)
    sorted_ids, order = torch.sort(ids[0])
    ys = torch.cat([native.experts(normed, list(experts[e]), len(experts[e])) for e in sorted_ids.tolist()])
    return h + native.combine(ys, weights[0, order])


@pytest.mark.parametrize("fused_layout", [True, False])  # gate_up [2I, H] or gate, up apart (mixtral)
@pytest.mark.parametrize("H,I,E,k,norm", [(96, 64, 8, 2, True), (100, 37, 13, 5, False), (64, 32, 64, 8, True)])
def test_fused_layer_gives_the_unfused_bits(fused_layout, H, I, E, k, norm):
    experts = _experts(E, H, I, fused_layout, seed=H + I)
    layer = moe.ResidentMoeLayer(_rand(H, seed=5).abs() + 0.5, 1e-6, _rand(E, H, seed=6), k, norm, experts)
    for seed in range(3):
        h = _rand(1, H, seed=10 + seed)
        fused = layer(h)
        assert fused.shape == (1, H) and fused.dtype == torch.bfloat16
        assert torch.equal(fused, _apart(layer, experts, h))


def test_bad_operands_are_refused():
    h = _rand(1, 64, seed=0)
    table = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="experts must be int64"):
        native.moe_layer(h, _rand(64, seed=1), 1e-6, _rand(8, 64, seed=2), 2, True, table, 16)
    with pytest.raises(RuntimeError, match="norm_w"):
        native.moe_layer(h, _rand(63, seed=1), 1e-6, _rand(4, 64, seed=2), 2, True, table, 16)
    with pytest.raises(RuntimeError, match="k must be"):
        native.route_topk(h, _rand(4, 64, seed=2), 5, True)


# --- in the engine -----------------------------------------------------------------------------

def test_resident_decode_runs_one_call_per_moe_layer(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        engine.model.plan_decode(engine.kv, whole_step=False)  # per-layer calls (the whole step in one: test_the_step_loop_...)
        generate(engine, PROMPT, 1, Sampler())
        fused, batched = count_calls(monkeypatch, "moe_layer"), count_calls(monkeypatch, "experts")
        engine.forward([11], len(PROMPT))
        engine.forward([12], len(PROMPT) + 1)
        assert len(fused) == 2 * sum(engine.args.moe_layer_flags) and batched == []


def test_fused_and_unfused_decode_give_the_same_logits(bf16_model):
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=32)) as engine:
        model = engine.model
        model.plan_decode(engine.kv, whole_step=False)
        generate(engine, PROMPT, 1, Sampler())
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert all(layer is not None for layer in model.plan.moe)
        model.plan_decode(engine.kv, whole_step=False, fused_moe=False)  # the unfused path
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
    assert all(torch.equal(f, s) for f, s in zip(fused, apart))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_step_loop_gives_the_per_layer_bits_in_one_call_per_token(bf16_model, monkeypatch, threads):
    with Engine(bf16_model, EngineConfig(threads=threads, ctx_size=32)) as engine:
        model = engine.model
        generate(engine, PROMPT, 1, Sampler())
        steps, layers = count_calls(monkeypatch, "decode_layers"), count_calls(monkeypatch, "moe_layer")
        looped = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(steps) == 2 and layers == []
        model.plan_decode(engine.kv, whole_step=False)  # one call per attention half and per MoE layer
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]  # same KV rows rewritten
        assert len(steps) == 2 and len(layers) == 2 * engine.args.num_layers
        model.plan_decode(engine.kv)
        cache = engine.kv.k[0].clone()
        engine.forward([13], len(PROMPT) + 2)  # K/V written by the loop, at its position only
        assert torch.equal(engine.kv.k[0][:, :len(PROMPT) + 2], cache[:, :len(PROMPT) + 2])
        assert not torch.equal(engine.kv.k[0][:, len(PROMPT) + 2], cache[:, len(PROMPT) + 2])
    assert all(torch.equal(f, s) for f, s in zip(looped, apart))


def test_watching_the_routing_takes_the_unfused_path(bf16_model, monkeypatch):
    # (a routing trim does not: the fused ops apply it, tests/test_native_trim.py)
    config = EngineConfig(threads=1, ctx_size=32, top_k_reduction=1)
    with Engine(bf16_model, config) as engine:
        engine.record_routing()  # the log wants each layer's ids, which the fused call keeps inside
        fused, steps = count_calls(monkeypatch, "moe_layer"), count_calls(monkeypatch, "decode_layers")
        generate(engine, PROMPT, 3, Sampler())
        assert fused == [] and steps == []
        assert all(len(calls) == 3 for calls in engine.model.routing_log)


def test_without_native_ops_decode_runs_on_torch(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        reference = generate(engine, PROMPT, 4, Sampler()).output_ids
        monkeypatch.setattr(native, "ready", False)  # as COLIBRI_NATIVE=0 or a CPU without avx512_bf16
        assert engine.model.plan_decode(engine.kv).route == "reference"  # (the route is chosen at load)
        fused, norms = count_calls(monkeypatch, "moe_layer"), count_calls(monkeypatch, "rms_norm")
        steps = count_calls(monkeypatch, "decode_layers")
        slow = generate(engine, PROMPT, 4, Sampler()).output_ids
        assert fused == [] and norms == [] and steps == [] and len(slow) == len(reference)


def test_a_router_rule_it_does_not_cover_falls_back(tmp_path, monkeypatch):
    geometry = {**synth.load_preset("glm4-moe-small"), "name": "glm4-test", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
                "vocab_size": 300, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "dtype": "bfloat16", "max_shard_size": 1 << 18}
    d = synth.synthesize(geometry, tmp_path / "glm", progress=False)
    with Engine(d, EngineConfig(threads=1, ctx_size=32)) as engine:
        assert engine.args.router is not None  # sigmoid, grouped, biased choice
        fused, steps = count_calls(monkeypatch, "moe_layer"), count_calls(monkeypatch, "decode_layers")
        assert len(generate(engine, PROMPT, 3, Sampler()).output_ids) == 3
        assert fused == [] and steps == [] and set(engine.model.plan.moe) <= {None}
