"""Lossy engine settings, off by default: the quantized KV cache (kv_dtype int8 / fp8) and the
routing trims (top_k_reduction, expert_threshold). Each must change nothing when off, change the
computation when on, and stay close to the lossless output where it claims to."""

import psutil
import pytest
import torch

from engine.arch.model import Transformer

from engine.format.checkpoint import Checkpoint
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError, ConfigError
from engine.run.generate import Sampler, generate
from engine.arch.kvquant import SCALE_BYTES, QuantizedRows
from engine.format.layout import ExpertLayout
from engine.arch.registry import model_args
from engine.movement.plan import make_plan
from engine.arch.router import RoutingTrim
from engine.run.runtime import Engine
from colibri_hf_models import build

PROMPT = [(7 * i + 3) % 256 for i in range(24)]
CTX = 64


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("lossy-qwen")
    build("qwen3_moe", d, mlp_only_layers=[])
    return d


@pytest.fixture(scope="module")
def qwen_reference(qwen):
    with Engine(qwen, EngineConfig(threads=1, ctx_size=CTX)) as engine:
        logits = engine.forward(PROMPT, 0)
        return logits, generate(engine, PROMPT, 8, Sampler()).output_ids


def _logits_and_tokens(model_dir, **settings):
    with Engine(model_dir, EngineConfig(threads=1, ctx_size=CTX, **settings)) as engine:
        logits = engine.forward(PROMPT, 0)
        return logits, generate(engine, PROMPT, 8, Sampler()).output_ids, engine


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- QuantizedRows ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, bound", [("int8", 1 / 127), ("fp8", 1 / 16)])
def test_quantized_rows_round_trip_within_the_codes_step(kind, bound):
    torch.manual_seed(0)
    rows = QuantizedRows((3, 10, 16), kind, torch.float32)
    values = torch.randn(3, 4, 16) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]  # a scale per head
    rows[:, 2:6] = values
    back = rows[:, 2:6]
    # Per-row scales: each row's error is bounded by its own magnitude, whatever the others'.
    err = (back - values).abs().amax(-1) / values.abs().amax(-1)
    assert float(err.max()) <= bound
    assert rows.codes.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    assert torch.equal(rows[:, :2], torch.zeros(3, 2, 16))  # untouched positions read as zeros


def test_quantized_rows_keep_zero_rows_zero():
    rows = QuantizedRows((4, 8), "int8", torch.bfloat16)
    rows[0:2] = torch.zeros(2, 8)
    assert torch.equal(rows[0:2], torch.zeros(2, 8, dtype=torch.bfloat16))
    assert rows[0:2].dtype is torch.bfloat16  # reads come back in the compute dtype


# --- the quantized KV cache in the engine ------------------------------------------------------

def _kl(logits: torch.Tensor, ref: torch.Tensor) -> float:
    lr, lq = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
    return float((lr.exp() * (lr - lq)).sum(-1).mean())


# int8 keeps 8 bits of each row's range; e4m3 has 3 mantissa bits (a 6% step), and on a random
# tiny MoE model a nudged hidden state can flip a routing choice: the bounds say so.
@pytest.mark.parametrize("kind, max_kl, min_top1", [("int8", 0.005, 0.9), ("fp8", 0.2, 0.8)])
def test_quantized_kv_logits_close_to_full_precision(qwen, qwen_reference, kind, max_kl, min_top1):
    ref_logits, _ = qwen_reference
    logits, _, engine = _logits_and_tokens(qwen, kv_dtype=kind)
    assert isinstance(engine.kv.k[0], QuantizedRows) and engine.kv.k[0].kind == kind
    assert not torch.equal(logits, ref_logits)  # the cache really was quantized
    assert _kl(logits, ref_logits) < max_kl
    assert float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()) >= min_top1
    # The first position attends to itself only: no routing flip upstream, the cache's own error.
    assert _relative_error(logits[0], ref_logits[0]) < (0.02 if kind == "int8" else 0.1)


def test_quantized_kv_bytes_are_planned_and_allocated(qwen):
    with Engine(qwen, EngineConfig(threads=1, ctx_size=CTX)) as full, \
            Engine(qwen, EngineConfig(threads=1, ctx_size=CTX, kv_dtype="int8")) as quant:
        a = quant.args
        rows = 2 * a.num_layers * a.num_kv_heads * CTX
        assert quant.plan.kv_bytes == rows * a.head_dim + rows * SCALE_BYTES
        allocated = sum(t.codes.nbytes + t.scales.nbytes for t in quant.kv.k + quant.kv.v)
        assert allocated == quant.plan.kv_bytes
        assert full.plan.kv_bytes == rows * a.head_dim * 4  # the fp32 test model's cache
        assert quant.plan.kv_bytes < full.plan.kv_bytes / 3


def test_a_budget_the_full_cache_exceeds_fits_the_quantized_one(qwen):
    """The plan charges the quantized cache's own bytes: codes and scales, not the compute dtype's."""
    ckpt = Checkpoint(qwen)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    # A set prefill group: the default one would shrink to make room for the larger cache.
    config = EngineConfig(ctx_size=4096, ram_budget=1 << 40, prefill_chunk=4096)
    quant = make_plan(ckpt, args, layout, config, torch.float32, "int8", overhead_bytes=64 << 20)
    full = make_plan(ckpt, args, layout, config, torch.float32, torch.float32, overhead_bytes=64 << 20)
    assert full.kv_bytes - quant.kv_bytes > 2 << 20
    # The group's state without the norm: a budget this tight leaves no room to hold it (plan.prefill_norm_held)
    prefill = quant.prefill_bytes - (4096 * args.hidden_size * 4 if quant.prefill_norm_held else 0)
    fixed = quant.dense_bytes + quant.kv_bytes + quant.buffer_bytes + quant.overhead_bytes + prefill
    tight = config.replace(ram_budget=fixed + (1 << 20))
    assert make_plan(ckpt, args, layout, tight, torch.float32, "int8", overhead_bytes=64 << 20).streaming
    with pytest.raises(BudgetError, match="KV cache at ctx_size 4096 3.0 MiB"):
        make_plan(ckpt, args, layout, tight, torch.float32, torch.float32, overhead_bytes=64 << 20)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_latent_cache_quantizes_and_stays_close(arch, tmp_path):
    build(arch, tmp_path)
    with Engine(tmp_path, EngineConfig(threads=1, ctx_size=CTX)) as full:
        ref = full.forward(PROMPT, 0)
    with Engine(tmp_path, EngineConfig(threads=1, ctx_size=CTX, kv_dtype="int8")) as quant:
        logits = quant.forward(PROMPT, 0)
        kv = quant.kv
        buffers = kv.latent + kv.rope_key + list(kv.index_key.values())
        assert all(isinstance(b, QuantizedRows) for b in buffers)
        assert quant.plan.kv_bytes == sum(b.codes.nbytes + b.scales.nbytes for b in buffers)
    assert not torch.equal(logits, ref)
    # Per position the cache's error is ~1%; a few positions move more where a nudged score flips a
    # discrete choice downstream (group routing, the indexer's top-k): the median says the former.
    per_position = (logits - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert float(per_position.median()) < 0.03 and float(per_position[0]) < 0.02
    assert float((logits.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_windowed_sink_attention_refuses_a_quantized_cache(tmp_path):
    build("gpt_oss", tmp_path)
    with pytest.raises(ConfigError, match="gpt_oss's attention cache has no quantized form") as err:
        Engine(tmp_path, EngineConfig(threads=1, ctx_size=CTX, kv_dtype="fp8"))
    assert "\n" not in str(err.value)


def test_kv_dtype_off_changes_nothing(qwen, qwen_reference):
    ref_logits, ref_tokens = qwen_reference
    logits, tokens, _ = _logits_and_tokens(qwen, kv_dtype="auto", top_k_reduction=0, expert_threshold=0.0)
    assert torch.equal(logits, ref_logits) and tokens == ref_tokens


# --- routing trims ------------------------------------------------------------------------------

def test_trim_keeps_the_heaviest_and_renormalizes_as_the_rule_does():
    ids = torch.tensor([[4, 1, 7]])
    weights = torch.tensor([[0.2, 0.5, 0.3]]) * 2.5  # a routed scaling factor: the total is 2.5
    kept_ids, kept = RoutingTrim(1, 0.0, True).apply(ids, weights)
    assert kept_ids.tolist() == [[1, 7]]
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3]]) * 2.5 / 0.8)
    _, raw = RoutingTrim(1, 0.0, False).apply(ids, weights)  # no norm_topk_prob: raw probabilities
    assert torch.allclose(raw, torch.tensor([[0.5, 0.3]]) * 2.5)


def test_threshold_skips_light_experts_but_never_the_heaviest():
    ids = torch.tensor([[4, 1, 7], [2, 3, 5]])
    weights = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    kept_ids, kept = RoutingTrim(0, 0.25, True).apply(ids, weights)  # several tokens: skipped slots are -1
    assert kept_ids.tolist() == [[1, 7, -1], [5, -1, -1]]
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0], [1.0, 0.0, 0.0]]))
    one_ids, one = RoutingTrim(0, 0.99, True).apply(ids[1:], weights[1:])  # one token: dropped
    assert one_ids.tolist() == [[5]] and torch.allclose(one, torch.tensor([[1.0]]))


def test_top_k_reduction_changes_the_output_only_when_enabled(qwen, qwen_reference):
    ref_logits, ref_tokens = qwen_reference
    logits, tokens, engine = _logits_and_tokens(qwen, top_k_reduction=1)
    assert not torch.allclose(logits, ref_logits, atol=1e-3)
    # top_k 2 → 1: on this model the threshold that skips every second expert is the same rule.
    t_logits, t_tokens, _ = _logits_and_tokens(qwen, expert_threshold=0.99)
    assert torch.allclose(t_logits, logits, atol=1e-5) and t_tokens == tokens


def test_trimmed_routing_is_what_the_layer_and_lookahead_use(qwen):
    config = EngineConfig(threads=1, ctx_size=CTX, top_k_reduction=1)
    with Engine(qwen, config) as engine:
        hinted = []
        engine.model.experts.hint_experts = lambda layer, ids: hinted.append(list(ids))
        # Resident, the engine builds its model without lookahead: the same weights and store with it on.
        engine.model = Transformer(engine.args, engine.model.w, engine.experts, engine.dtype, engine.kv,
                                   prefetch_depth=1, routing_trim=engine.model.routing_trim)
        engine.record_routing()
        generate(engine, PROMPT, 3, Sampler())
        widths = {ids.shape[1] for calls in engine.model.routing_log for ids in calls}
    assert widths == {engine.args.top_k - 1}
    decode_hints = [h for h in hinted if len(h) <= engine.args.top_k]
    assert decode_hints and all(len(h) == engine.args.top_k - 1 for h in decode_hints[-4:])


def test_trim_under_streaming_keeps_its_tokens(qwen):
    """Placement still never changes tokens: a trimmed model streamed gives the resident tokens."""
    lossy = dict(threads=1, ctx_size=CTX, top_k_reduction=1, expert_threshold=0.3)
    with Engine(qwen, EngineConfig(**lossy)) as resident:
        want = generate(resident, PROMPT, 6, Sampler()).output_ids
    budget = psutil.Process().memory_info().rss + (200 << 20)  # the runtime's overhead is this process's RSS
    with Engine(qwen, EngineConfig(**lossy, ram_budget=budget, cpu_cache_ratio=0.0, prefetch_depth=2,
                                   io_mode="buffered")) as streamed:
        assert streamed.plan.streaming
        assert generate(streamed, PROMPT, 6, Sampler()).output_ids == want


@pytest.mark.parametrize("settings, needle", [
    (dict(top_k_reduction=2), "top_k_reduction 2 leaves no expert: the model routes 2 per token"),
    (dict(top_k_reduction=-1), "top_k_reduction must be in [0, 8]"),
    (dict(expert_threshold=1.0), "expert_threshold must be a number in [0, 1)"),
    (dict(kv_dtype="int4"), "kv_dtype must be one of"),
])
def test_bad_lossy_settings_are_one_line_errors(qwen, settings, needle):
    with pytest.raises(ConfigError) as err:
        Engine(qwen, EngineConfig(threads=1, ctx_size=CTX, **settings))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_lossy_settings_round_trip_through_toml(tmp_path):
    config = EngineConfig(kv_dtype="fp8", top_k_reduction=1, expert_threshold=0.05)
    config.save(tmp_path / "c.toml")
    assert EngineConfig.load(tmp_path / "c.toml") == config
