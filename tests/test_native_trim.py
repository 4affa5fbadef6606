"""Routing trims (top_k_reduction, expert_threshold) inside the fused native MoE layers
(engine/native/moe_kernels.h trim_experts; moe_layer_bf16, moe_layer_int, decode_layers_bf16): the
experts they keep and the weights they give them are RoutingTrim.apply's bit for bit, so a trimmed
run fused and unfused gives the same logits and tokens, for bf16, int8 and int4 experts, on a model
that renormalises its top-k weights and on one that does not."""

import pytest
import torch

from engine import native
from engine.arch import moe, moe_quant
from engine.arch.router import RoutingTrim
from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.weights.quantized import QuantWeight, quantize
from engine.run.runtime import Engine
from colibri_native_cases import PROMPT, count_calls, int8_native_on, needs_native_int, rand_bf16  # noqa: F401
from colibri_tiny import make_tiny

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernels: {WHY_NOT}")
int_only = needs_native_int()

TRIMS = [RoutingTrim(r, t, norm) for norm in (True, False)
         for r, t in ((1, 0.0), (2, 0.0), (0, 0.05), (0, 0.2), (0, 0.5), (1, 0.2))]


def _router_with_ties(E: int, H: int, seed: int) -> torch.Tensor:
    """Router rows where experts 1..4 have one row: equal logits, equal weights, so the trim's cut
    falls between tied experts and the order of equal weights decides who stays."""
    w = rand_bf16(E, H, seed=seed)
    w[1:5] = w[1]
    return w


def _apart(layer, experts: list[tuple], h: torch.Tensor, trim: RoutingTrim, expert) -> torch.Tensor:
    """The trimmed layer as the unfused decode computes it: norm, route, RoutingTrim.apply on the bf16
    weights, each kept expert alone in ascending id order, combine, residual add."""
    normed = native.rms_norm(h, layer.norm_w, layer.eps)
    ids, weights = trim.apply(*native.route_topk(normed, layer.router_w, layer.top_k, layer.norm_topk))
    assert weights.dtype == torch.bfloat16
    sorted_ids, order = torch.sort(ids[0])
    ys = torch.cat([expert(normed, experts[e]) for e in sorted_ids.tolist()])
    return h + native.combine(ys, weights[0, order])


def _bf16_experts(n: int, H: int, I: int, seed: int) -> list[tuple]:
    return [(rand_bf16(I, H, seed=seed + 3 * e, scale=0.2), rand_bf16(I, H, seed=seed + 3 * e + 1, scale=0.2),
             rand_bf16(H, I, seed=seed + 3 * e + 2, scale=0.2)) for e in range(n)]


def _quant_experts(quant: str, group: int, n: int, H: int, I: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(QuantWeight.prepare(*quantize(torch.randn(*shape, generator=g) * 0.2, quant, group), quant, group,
                                      torch.bfloat16) for shape in ((I, H), (I, H), (H, I))) for _ in range(n)]


@pytest.mark.parametrize("trim", TRIMS, ids=str)
@pytest.mark.parametrize("ties", [False, True])
def test_fused_bf16_layer_trims_with_the_unfused_bits(trim, ties):
    from engine.arch.layers import swiglu_expert
    H, I, E, k = 96, 40, 12, 4
    experts = _bf16_experts(E, H, I, seed=7)
    router = _router_with_ties(E, H, seed=6) if ties else rand_bf16(E, H, seed=6)
    layer = moe.ResidentMoeLayer(rand_bf16(H, seed=5).abs() + 0.5, 1e-6, router, k, trim.renormalize, experts)
    untrimmed_differs = False
    for seed in range(6):
        h = rand_bf16(1, H, seed=20 + seed)
        fused = layer(h, trim)
        assert torch.equal(fused, _apart(layer, experts, h, trim, swiglu_expert))
        untrimmed_differs |= not torch.equal(fused, layer(h))
    assert untrimmed_differs or trim.reduction == 0  # a reduction always drops an expert


@int_only
@pytest.mark.parametrize("trim", TRIMS, ids=str)
@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32)])
def test_fused_int_layer_trims_with_the_unfused_bits(trim, quant, group):
    from engine.arch.layers import swiglu_expert
    H, I, E, k = 64, 64, 12, 4
    experts = _quant_experts(quant, group, E, H, I, seed=3)
    layer = moe_quant.resident_layer(rand_bf16(H, seed=5).abs() + 0.5, 1e-6, _router_with_ties(E, H, seed=8), k,
                                     trim.renormalize, experts)
    assert isinstance(layer, moe_quant.ResidentQuantMoeLayer)
    for seed in range(4):
        h = rand_bf16(1, H, seed=30 + seed)
        assert torch.equal(layer(h, trim), _apart(layer, experts, h, trim, swiglu_expert))


def test_the_threshold_compares_with_the_rounded_total_and_keeps_the_heaviest():
    """Weights whose bf16 total is not their fp32 one: the op's choice must be apply's on the bf16 weights."""
    H, I, E, k = 32, 16, 6, 3
    experts = _bf16_experts(E, H, I, seed=1)
    from engine.arch.layers import swiglu_expert
    layer = moe.ResidentMoeLayer(rand_bf16(H, seed=2).abs() + 0.5, 1e-6, rand_bf16(E, H, seed=3), k, True, experts)
    for threshold in (0.0, 0.1, 0.25, 0.3333, 0.34, 0.5, 0.999):
        trim = RoutingTrim(0, threshold, True)
        for seed in range(4):
            h = rand_bf16(1, H, seed=40 + seed)
            assert torch.equal(layer(h, trim), _apart(layer, experts, h, trim, swiglu_expert))


def test_a_trim_that_keeps_no_expert_is_refused():
    h = rand_bf16(1, 64, seed=0)
    table = torch.zeros(8, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="the trim must keep an expert"):
        native.moe_layer(h, rand_bf16(64, seed=1), 1e-6, rand_bf16(8, 64, seed=2), 2, True, table, 16, 2, 0.0, True)
    with pytest.raises(RuntimeError, match="the trim must keep an expert"):
        native.moe_layer(h, rand_bf16(64, seed=1), 1e-6, rand_bf16(8, 64, seed=2), 2, True, table, 16, 0, 1.5, True)


# --- in the engine: two tiny models (norm_topk_prob on and off), bf16, int8 and int4 experts ------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trim")
    out = {}
    for norm in (True, False):
        bf16 = make_tiny(root / f"bf16-{norm}", dtype="bfloat16", num_hidden_layers=3, num_experts_per_tok=4,
                         norm_topk_prob=norm)
        out["bf16", norm] = bf16
        if native.int_ready:
            for quant, group in (("int8", 0), ("int4", 32)):
                out[quant, norm] = convert(bf16, root / f"{quant}-{norm}", quant, group_size=group or 64,
                                           scope="experts")["path"]
    return out


def _greedy(path, trim: dict, step_loop: bool, tokens: int = 5) -> tuple[list, list]:
    """Per-token logits and greedy tokens of a resident trimmed decode."""
    with Engine(path, EngineConfig(threads=2, ctx_size=32, **trim)) as engine:
        assert (engine.model.routing_trim is not None) == bool(trim)
        engine.model.plan_decode(engine.kv, whole_step=step_loop)
        logits = engine.forward(PROMPT, 0, last_only=True)
        out, ids = [], []
        for i in range(tokens):
            token = int(logits[-1].argmax())
            ids.append(token)
            logits = engine.forward([token], len(PROMPT) + i)
            out.append(logits)
    return out, ids


ENGINE_TRIMS = [dict(top_k_reduction=1), dict(top_k_reduction=2), dict(expert_threshold=0.05),
                dict(expert_threshold=0.2), dict(expert_threshold=0.5)]


@pytest.mark.parametrize("trim", ENGINE_TRIMS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("norm", [True, False], ids=["renormalize", "raw"])
@pytest.mark.parametrize("experts", ["bf16", "int8", "int4"])
def test_a_trimmed_decode_fused_gives_the_unfused_logits(models, trim, norm, experts, monkeypatch):
    if (experts, norm) not in models:
        pytest.skip("native int kernels unavailable (no VNNI/VBMI)")
    path = models[experts, norm]
    op = "moe_layer" if experts == "bf16" else "moe_layer_int"
    runs = {}
    for step_loop in ((True, False) if experts == "bf16" else (False,)):  # the whole-step op is bf16-only
        layers, steps = count_calls(monkeypatch, op), count_calls(monkeypatch, "decode_layers")
        runs[step_loop] = _greedy(path, trim, step_loop)
        if step_loop:
            assert len(steps) == 5 and layers == []  # one whole-step call per decoded token
        else:
            assert len(layers) == 5 * 3 and steps == []  # one fused call per MoE layer per token
    real = moe.resident_layer
    monkeypatch.setattr(moe, "resident_layer", lambda *a: None)  # no layer fuses: the unfused path
    fused_calls = count_calls(monkeypatch, op)
    apart_logits, apart_tokens = _greedy(path, trim, step_loop=True)
    assert fused_calls == []
    for logits, tokens in runs.values():
        assert tokens == apart_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, apart_logits))
    if "top_k_reduction" in trim:  # the trim reached the fused layers: not the untrimmed logits
        monkeypatch.setattr(moe, "resident_layer", real)
        untrimmed, _ = _greedy(path, {}, step_loop=False)
        assert not all(torch.equal(a, b) for a, b in zip(untrimmed, runs[False][0]))
