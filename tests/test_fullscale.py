"""The engine's metadata path at the published scale: DeepSeek-V3 671B written as sparse files
(benchmarks/formats/fullscale_build.py, fullscale.py's builder: real headers and index, holes for
the bytes; ~10 MB on disk).

Opens the 163-shard, 46k-tensor bf16 variant (the FP8 one needs the FP8 reader), lays out its
14,848 routed experts (one read each), and plans it: the figures docs/BENCHMARKS.md reports come
from the same path. No timing assertions; the sizes are the behaviour under test.
"""

import json
import math

import pytest
import torch

from benchmarks.formats.fullscale_build import build
from engine.arch.registry import model_args
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError
from engine.format.checkpoint import Checkpoint
from engine.format.layout import ExpertLayout
from engine.movement.plan import make_plan

GiB = 1 << 30


@pytest.fixture(scope="module")
def deepseek_bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("fullscale") / "deepseek-v3"
    info = build("deepseek-v3", d, "bf16")
    return d, info


def test_sparse_build_costs_no_disk(deepseek_bf16):
    _, info = deepseek_bf16
    assert info["shards"] == 163 and info["tensors"] == 46183
    assert info["apparent_bytes"] > 1.3e12 and info["disk_bytes"] < 64 << 20


def test_engine_opens_lays_out_and_plans_the_full_model(deepseek_bf16):
    d, info = deepseek_bf16
    ckpt = Checkpoint(d)
    assert len(ckpt.tensors) == info["tensors"]
    assert ckpt.nbytes() == info["apparent_bytes"]
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    # 58 MoE layers x 256 experts; the MTP layer 61 is in the files but not a layer the engine runs
    assert layout.num_routed == 58 * 256
    assert "model.layers.61.eh_proj.weight" in ckpt and (61, 0) not in set(layout.keys())
    assert layout.spans_per_expert == 1  # gate, up, down adjacent: one read per expert
    assert layout.expert_nbytes == 3 * 2048 * 7168 * 2
    # 16 GiB cannot hold DeepSeek-V3's ~32 GiB of bf16 dense weights: one line naming the parts
    with pytest.raises(BudgetError) as err:
        make_plan(ckpt, args, layout, EngineConfig(ram_budget=16 * GiB), torch.bfloat16, torch.bfloat16,
                  overhead_bytes=1 * GiB)
    assert "dense weights 31.9 GiB" in str(err.value) and "\n" not in str(err.value)
    plan = make_plan(ckpt, args, layout, EngineConfig(ram_budget=64 * GiB), torch.bfloat16, torch.bfloat16,
                     overhead_bytes=1 * GiB)
    assert plan.streaming and plan.routed_experts == 58 * 256 and plan.cache_slots > 0


def test_fp8_variant_has_the_published_names_and_block_scales(tmp_path):
    info = build("deepseek-v3", tmp_path / "fp8", "fp8")
    assert info["shards"] == 163 and info["tensors"] == 91991
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / "fp8" / index["model.layers.7.mlp.experts.200.down_proj.weight"]
    with open(shard, "rb") as f:  # the header only: the rest is gigabytes of hole
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    weight = header["model.layers.7.mlp.experts.200.down_proj.weight"]
    scale = header["model.layers.7.mlp.experts.200.down_proj.weight_scale_inv"]
    assert weight["dtype"] == "F8_E4M3" and weight["shape"] == [7168, 2048]
    assert scale["dtype"] == "F32" and scale["shape"] == [56, 16]
    kv_b = header.get("model.layers.7.self_attn.kv_b_proj.weight_scale_inv")
    if kv_b is not None:  # [128 heads x (128 + 128), 512] → 256 x 4 blocks
        assert kv_b["shape"] == [math.ceil(32768 / 128), 4]
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


def test_int4_container_variant_plans_within_16_gib(tmp_path):
    """Our `--scope all` int4 container of the same geometry: the dense part fits 16 GiB, and the
    cost model's geometry reads its quantized dense matrices (it used to ask for lm_head.weight)."""
    from tuner.costmodel.model_geometry import from_model_dir
    d = tmp_path / "int4"
    build("deepseek-v3", d, "int4")
    ckpt = Checkpoint(d)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    assert layout.quant.quant == "int4" and layout.spans_per_expert == 1
    plan = make_plan(ckpt, args, layout, EngineConfig(ram_budget=16 * GiB), torch.bfloat16, torch.bfloat16,
                     overhead_bytes=1 * GiB)
    # 11.6 GiB: int4 projections + bf16 embeddings + kv_b_proj dequantized at load (2 GiB in bf16);
    # the plan also charges the prefill group's activations (~1.2 GiB at this width for the whole 2,048-token
    # context as one group: tests/test_prefill_charge.py holds the charge above what a prefill allocates),
    # so ~100 slots remain
    assert plan.streaming and plan.dense_bytes < 12 * GiB and plan.prefill_bytes < 1.25 * GiB
    assert plan.cache_slots >= 64
    geometry = from_model_dir(d)
    shapes = {t.name: t.shape for t in geometry.dense}
    assert shapes["lm_head.weight"] == (129280, 7168)
    assert shapes["model.layers.5.self_attn.o_proj.weight"] == (7168, 16384)


def test_decodable_build_writes_the_scales_and_biases_a_decode_step_reads():
    """`build --decodable`: the bytes a decode step on holes reads are real — int4 scales whose
    hole codes dequantize to exactly 0, FP8 scales 1.0, and router biases that make experts
    0..K-1 win every tie — and nothing else (an expert the router never picks stays a hole)."""
    from benchmarks.formats.fullscale_build import _real_bytes
    from engine.weights.quantized import dequantize_int4
    K = 8
    qscale = _real_bytes("model.layers.5.mlp.experts.3.down_proj.qscale", "BF16", (16, 7168, 2), K)
    codes = torch.zeros(7168, 1024, dtype=torch.uint8)  # a hole: every nibble 0
    scales = torch.frombuffer(bytearray(qscale), dtype=torch.bfloat16).view(16, 7168, 2)
    assert bool((scales[..., 0] > 0).all()) and float(dequantize_int4(codes, scales, 128).abs().max()) == 0.0
    assert _real_bytes("model.layers.5.mlp.experts.8.down_proj.qscale", "BF16", (16, 7168, 2), K) is None
    assert _real_bytes("model.layers.5.mlp.experts.8.down_proj.qweight", "U8", (7168, 1024), K) is None
    fp8_scale = _real_bytes("model.layers.5.self_attn.o_proj.weight_scale_inv", "F32", (56, 128), K)
    assert torch.equal(torch.frombuffer(bytearray(fp8_scale), dtype=torch.float32), torch.ones(56 * 128))
    bias = torch.frombuffer(bytearray(_real_bytes("model.layers.5.mlp.gate.e_score_correction_bias", "F32", (256,), K)),
                            dtype=torch.float32)
    assert torch.equal(bias.topk(K).indices.sort().values, torch.arange(K))  # ties broken toward 0..K-1


def test_reduced_layer_variant_keeps_the_per_layer_geometry(tmp_path):
    """`build --layers N`: the first N layers of the same model (widths, experts, shard size), so a
    memory figure measured on a few layers scales by the layer count. One more MoE layer adds
    exactly one layer's dense bytes to the plan and 256 experts to the layout, and the full model's
    dense part is the reduced one's plus its other layers at that rate."""
    def planned(layers):
        d = tmp_path / f"l{layers}"
        info = build("deepseek-v3", d, "int4", layers=layers)
        ckpt = Checkpoint(d)
        args = model_args(ckpt.config)
        layout = ExpertLayout(ckpt, args)
        plan = make_plan(ckpt, args, layout, EngineConfig(ram_budget=64 * GiB), torch.bfloat16, torch.bfloat16,
                         overhead_bytes=1 * GiB)
        return info, args, layout, plan
    info4, args4, layout4, plan4 = planned(4)
    info5, args5, layout5, plan5 = planned(5)
    assert (args4.num_layers, args5.num_layers) == (4, 5)
    assert (layout4.num_routed, layout5.num_routed) == (256, 512)
    assert info5["shards"] > info4["shards"] >= 1
    assert "model.layers.5.eh_proj.weight" in Checkpoint(tmp_path / "l5")  # the MTP layer follows the last one
    per_layer = plan5.dense_bytes - plan4.dense_bytes
    # one MoE layer: int4 attention and shared expert, kv_b_proj dequantized to bf16, router in bf16
    assert 140e6 < per_layer < 160e6
    with pytest.raises(ValueError):
        build("deepseek-v3", tmp_path / "bad", "int4", layers=3)  # no MoE layer left
