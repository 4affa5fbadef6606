"""The fused MoE decode layer for int8 / int4 experts (engine/native/moe_decode_int.cpp,
engine/arch/moe_quant.py): bit-equal to its pieces called apart (what the streaming path runs) on
odd shapes and partial int4 blocks, taken by resident decode of a converted container with the same
logits as the unfused path, and not taken where the native int kernels are off."""

import pytest
import torch

from engine import native
from engine.arch import moe_quant
from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.weights.quantized import QuantWeight, quantize
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_native_cases import (PROMPT, bf16_model, count_calls, int8_native_on,  # noqa: F401 (fixtures)
                                  needs_native_int, rand_bf16)

pytestmark = needs_native_int()


def _experts(quant: str, group: int, n: int, H: int, I: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mats = [torch.randn(I, H, generator=g) * 0.2, torch.randn(I, H, generator=g) * 0.2,
                torch.randn(H, I, generator=g) * 0.2]
        out.append(tuple(QuantWeight.prepare(*quantize(m, quant, group), quant, group, torch.bfloat16) for m in mats))
    return out


def _apart(layer: moe_quant.ResidentQuantMoeLayer, experts: list[tuple], h: torch.Tensor) -> torch.Tensor:
    """The layer as the unfused decode computes it with native ops loaded: norm, route, each expert
    alone (the streaming path's per-expert call) in ascending id order, combine, residual add."""
    from engine.arch.layers import swiglu_expert
    normed = native.rms_norm(h, layer.norm_w, layer.eps)
    ids, weights = native.route_topk(normed, layer.router_w, layer.top_k, layer.norm_topk)
    sorted_ids, order = torch.sort(ids[0])
    ys = torch.cat([swiglu_expert(normed, experts[e]) for e in sorted_ids.tolist()])
    return h + native.combine(ys, weights[0, order])


# int8 with a ragged H and an odd I; int4 g32 with I = 160 (a partial last 64-row block in gate/up)
# and H = 96 (a partial block in down); int4 g64 and g128 with full blocks.
@pytest.mark.parametrize("quant,group,H,I,E,k,norm", [
    ("int8", 0, 100, 37, 13, 5, False), ("int8", 0, 64, 32, 64, 8, True),
    ("int4", 32, 96, 160, 8, 2, True), ("int4", 64, 128, 192, 16, 4, False), ("int4", 128, 256, 128, 6, 6, True)])
def test_fused_layer_gives_the_unfused_bits(quant, group, H, I, E, k, norm):
    experts = _experts(quant, group, E, H, I, seed=H + I)
    layer = moe_quant.resident_layer(rand_bf16(H, seed=5).abs() + 0.5, 1e-6, rand_bf16(E, H, seed=6), k, norm,
                                     experts)
    assert isinstance(layer, moe_quant.ResidentQuantMoeLayer) and layer.group == group
    for seed in range(3):
        h = rand_bf16(1, H, seed=10 + seed)
        fused = layer(h)
        assert fused.shape == (1, H) and fused.dtype == torch.bfloat16
        assert torch.equal(fused, _apart(layer, experts, h))


def test_it_is_not_built_where_the_native_kernels_would_not_run(monkeypatch):
    experts = _experts("int8", 0, 4, 64, 32, seed=1)
    args = (rand_bf16(64, seed=5), 1e-6, rand_bf16(4, 64, seed=6), 2, True)
    monkeypatch.setattr(native, "int8_decode", False)  # COLIBRI_NATIVE_INT8=0: torch's int8 kernel
    assert moe_quant.resident_layer(*args, experts) is None
    monkeypatch.setattr(native, "int8_decode", True)
    monkeypatch.setattr(native, "int_ready", False)  # a CPU without VNNI / VBMI
    assert moe_quant.resident_layer(*args, experts) is None
    monkeypatch.setattr(native, "int_ready", True)
    mixed = experts[:3] + _experts("int4", 32, 1, 64, 32, seed=2)
    assert moe_quant.resident_layer(*args, mixed) is None
    assert moe_quant.resident_layer(*args, [tuple(rand_bf16(*s, seed=3) for s in ((32, 64), (32, 64), (64, 32)))]
                                    * 4) is None  # bf16 experts: moe.ResidentMoeLayer's


def test_bad_operands_are_refused():
    h = rand_bf16(1, 64, seed=0)
    with pytest.raises(RuntimeError, match="experts must be int64"):
        native.moe_layer_int(h, rand_bf16(64, seed=1), 1e-6, rand_bf16(8, 64, seed=2), 2, True,
                             torch.zeros(8, 3, dtype=torch.int64), 32, 0)
    with pytest.raises(RuntimeError, match="group"):
        native.moe_layer_int(h, rand_bf16(64, seed=1), 1e-6, rand_bf16(8, 64, seed=2), 2, True,
                             torch.zeros(8, 6, dtype=torch.int64), 48, 32)


# --- in the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def containers(bf16_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {(q, g): convert(bf16_model, root / f"{q}{g}", q, group_size=g or 64, scope="experts")["path"]
            for q, g in (("int8", 0), ("int4", 32))}


@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32)])
def test_resident_decode_runs_one_call_per_layer_with_the_unfused_logits(containers, quant, group, monkeypatch):
    with Engine(containers[quant, group], EngineConfig(threads=2, ctx_size=32)) as engine:
        model = engine.model
        generate(engine, PROMPT, 1, Sampler())
        fused_calls, batched = count_calls(monkeypatch, "moe_layer_int"), count_calls(monkeypatch, "quant_experts")
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(fused_calls) == 2 * sum(engine.args.moe_layer_flags) and batched == []
        assert all(isinstance(layer, moe_quant.ResidentQuantMoeLayer) for layer in model.plan.moe)
        model.plan_decode(engine.kv, fused_moe=False)  # the unfused path
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        assert len(batched) == 2 * sum(engine.args.moe_layer_flags)
    assert all(torch.equal(f, s) for f, s in zip(fused, apart))


def test_int8_off_keeps_the_unfused_torch_path(containers, monkeypatch):
    monkeypatch.setattr(native, "int8_decode", False)
    with Engine(containers["int8", 0], EngineConfig(threads=1, ctx_size=32)) as engine:
        fused_calls = count_calls(monkeypatch, "moe_layer_int")
        out = generate(engine, PROMPT, 3, Sampler()).output_ids
        assert fused_calls == [] and len(out) == 3
