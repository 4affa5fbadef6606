"""The native bf16 decode kernels (engine/native): right products, the same bits batched or per
expert, and a bf16 model's tokens independent of placement with them in the loop."""

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.base.config import EngineConfig
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_tiny import make_tiny
from test_streaming import budget_for_cache
from colibri_requirements import needs

WHY_NOT = native.load()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=needs("native", f"native kernels: {WHY_NOT}"))
PROMPT = [3, 17, 42, 5, 99, 7]


def bf16_close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within one bf16 rounding (plus fp32 summation-order noise) of an fp32 reference."""
    return bool(((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all())


def test_the_loaded_build_is_the_one_this_cpu_and_environment_name():
    """AVX-512 where the CPU has AVX512-BF16, else AVX2 (or AVX2 wherever COLIBRI_NATIVE_ISA=avx2 asks:
    tests/test_native_avx2.py runs these tests so); only the AVX-512 build carries the int8/int4 ops."""
    assert native.isa == native.isa_for(native.cpu_flags()) and native.isa in native.ISAS
    assert not native.int_ready or native.isa == "avx512"


@pytest.mark.parametrize("k", [32, 64, 100, 1024, 31])  # multiples of 32 and 64, and ragged tails
def test_linear_matches_an_fp32_reference(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(257, k, generator=g).bfloat16()
    y = native.linear(x, w)
    assert y.shape == (1, 257) and y.dtype == torch.bfloat16
    assert bf16_close(y, x.float() @ w.float().T)


@pytest.mark.parametrize("k", [64, 31])
def test_linear_adds_its_bias_before_the_one_rounding(k):
    """With a bias the sum is rounded once, as F.linear's addmm rounds it: a value whose dot and bias
    each round to bf16 apart would differ. A wrong-sized bias is refused."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(257, k, generator=g).bfloat16()
    bias = (torch.randn(257, generator=g) * 3).bfloat16()
    y = native.linear(x, w, bias)
    ref = x.float() @ w.float().T + bias.float()
    assert bf16_close(y, ref)
    twice = (native.linear(x, w).float() + bias.float()).bfloat16()
    assert (y != twice).any(), "the bias was added after the dot's rounding"
    with pytest.raises(RuntimeError, match="bias"):
        native.linear(x, w, bias[:-1])


def _experts(n: int, hidden: int, inter: int, fused: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.2).bfloat16()
        down = (torch.randn(hidden, inter, generator=g) * 0.2).bfloat16()
        out.append((gate_up, down) if fused else (gate_up[:inter].clone(), gate_up[inter:].clone(), down))
    return out


@pytest.mark.parametrize("fused", [True, False])
def test_experts_match_swiglu_and_batching_changes_no_bit(fused):
    hidden, inter = 96, 64
    x = (torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))).bfloat16()
    experts = _experts(5, hidden, inter, fused)
    batched = native.experts(x, [t for e in experts for t in e], len(experts[0]))
    assert batched.shape == (5, hidden)
    for j, weights in enumerate(experts):
        alone = native.experts(x, list(weights), len(weights))
        assert torch.equal(alone[0], batched[j])  # what streaming computes == what resident batches
        gate, up = (weights[0][:inter], weights[0][inter:]) if fused else weights[:2]
        h = (F.silu((x.float() @ gate.float().T).bfloat16()) * (x.float() @ up.float().T).bfloat16())
        assert bf16_close(batched[j:j + 1], h.float() @ weights[-1].float().T)


def test_bad_operands_are_refused():
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.linear(x, torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="gate_up"):
        native.experts(x, [torch.randn(12, 64).bfloat16(), torch.randn(64, 5).bfloat16()], 2)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("bf16") / "m", dtype="bfloat16", num_hidden_layers=3)


def test_resident_decode_takes_the_batched_path(bf16_model, monkeypatch):
    calls = []
    real = native.experts
    monkeypatch.setattr(native, "experts", lambda x, w, n: calls.append(len(w) // n) or real(x, w, n))
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        assert engine.native_unavailable is None
        # Without the fused layer (moe_layer_bf16: tests/test_native_moe.py), as under a routing trim or log.
        engine.model.plan_decode(engine.kv, fused_moe=False)
        generate(engine, PROMPT, 1, Sampler())  # prefill: an expert with one routed row runs alone
        calls.clear()
        engine.forward([11], len(PROMPT))
        engine.forward([12], len(PROMPT) + 1)
        args = engine.args
    # Decode: one call per MoE layer and token, all top-k experts in it.
    assert calls == [args.top_k] * (2 * sum(args.moe_layer_flags))


def test_native_and_torch_decode_agree(bf16_model, monkeypatch):
    with Engine(bf16_model, EngineConfig(threads=1, ctx_size=32)) as engine:
        generate(engine, PROMPT, 1, Sampler())  # prefill fills the KV cache
        fast = engine.forward([11], len(PROMPT))
        monkeypatch.setattr(native, "ready", False)  # torch's ops (F.linear, F.silu, mm) instead
        engine.model.plan_decode(engine.kv)  # the reference route (chosen at load: as a model loaded so)
        slow = engine.forward([11], len(PROMPT))
    assert torch.allclose(fast, slow, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("io_mode,prefetch", [("direct", 0), ("buffered", 1), ("mmap", 2)])
def test_bf16_placement_never_changes_tokens(bf16_model, io_mode, prefetch):
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=32)) as engine:
        reference = generate(engine, PROMPT, 8, Sampler()).output_ids  # resident: batched experts
    config = EngineConfig(threads=2, ctx_size=32, io_mode=io_mode, prefetch_depth=prefetch, io_threads=2)
    config = config.replace(ram_budget=budget_for_cache(bf16_model, config, cache_experts=6))
    with Engine(bf16_model, config) as engine:
        assert engine.plan.streaming  # experts one at a time, as their reads land
        assert generate(engine, PROMPT, 8, Sampler()).output_ids == reference


def test_fused_qkv_gives_the_unfused_bits(bf16_model):
    with Engine(bf16_model, EngineConfig(threads=2, ctx_size=32)) as engine:
        model = engine.model
        assert set(model._qkv) == set(range(engine.args.num_layers))  # every layer's q/k/v fused at load
        p = "model.layers.0.self_attn"
        # The dict's q/k/v are row views of the fused matrix: one copy of the bytes.
        assert model.w[f"{p}.q_proj.weight"].data_ptr() == model._qkv[0].data_ptr()
        # _attention's own path on both sides (not attention_decode_bf16: tests/test_native_attention.py)
        model.plan_decode(engine.kv, native_attention=False)
        generate(engine, PROMPT, 1, Sampler())
        fused = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]
        model._qkv = {}  # three projections again
        apart = [engine.forward([11], len(PROMPT)), engine.forward([12], len(PROMPT) + 1)]  # same KV rows rewritten
    assert all(torch.equal(f, s) for f, s in zip(fused, apart))
