"""`synth` writes real checkpoints of the new architectures: the `*-small` presets' structure at
test size, loaded by transformers and matched by our engine (fp32 on both sides)."""

import json

import pytest
import torch

from engine import synth
from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_hf_models import hf_greedy, hf_logits

ATOL = 1e-4
PROMPT = [(11 * i + 5) % 256 for i in range(24)]
TINY = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, vocab_size=300,
            max_shard_size=1 << 18)
# Each preset scaled to test size, structure kept (groups, dense first layer, indexer top-k
# below the prompt length, sliding window below it, MXFP4 experts).
SCALED = {
    "glm-5-small": dict(TINY, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
                        index_head_dim=16, index_topk=6),
    "deepseek-v3-small": dict(TINY, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                              moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16),
    "glm4-moe-small": dict(TINY, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           num_key_value_heads=2, head_dim=16),
    "gpt-oss-small": dict(TINY, num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=2, head_dim=16,
                          sliding_window=8),
}


def tiny_geometry(preset: str) -> dict:
    return {**synth.load_preset(preset), **SCALED[preset], "name": f"{preset}-test"}


@pytest.mark.parametrize("preset", sorted(SCALED))
def test_synthesized_model_matches_transformers(preset, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    d = synth.synthesize(tiny_geometry(preset), tmp_path / preset, seed=5, progress=False)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == synth.load_preset(preset)["model_type"]
    assert len(list(d.glob("model-*.safetensors"))) > 1
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if "quantization_config" in cfg else {}
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager", **extra).eval()
    with Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as engine:
        diff = (engine.forward(PROMPT, 0) - hf_logits(model, PROMPT)).abs().max().item()
        assert diff <= ATOL, f"{preset}: {diff:.3e}"
    with Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as engine:
        assert generate(engine, PROMPT, 8, Sampler()).output_ids == hf_greedy(model, PROMPT, 8)


def test_gpt_oss_mxfp4_synth_writes_published_layout(tmp_path):
    d = synth.synthesize(tiny_geometry("gpt-oss-small"), tmp_path / "g", seed=1, progress=False)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in index
    assert "model.layers.0.mlp.experts.gate_up_proj" not in index
    from engine.format.checkpoint import Checkpoint
    info = Checkpoint(d).info("model.layers.0.mlp.experts.down_proj_scales")
    assert info.dtype == "U8" and info.shape == (8, 64, 2)


def test_synthesis_is_deterministic(tmp_path):
    g = tiny_geometry("glm-5-small")
    a = synth.synthesize(g, tmp_path / "a", seed=2, progress=False)
    b = synth.synthesize(g, tmp_path / "b", seed=2, progress=False)
    for fa in sorted(a.glob("*.safetensors")):
        assert fa.read_bytes() == (b / fa.name).read_bytes()


@pytest.mark.parametrize("patch,needle", [
    (dict(topk_group=9), "topk_group 9 exceeds n_group 4"),
    (dict(kv_lora_rank=0), "kv_lora_rank must be >= 1"),
    (dict(expert_format="mxfp4"), "expert_format"),
])
def test_bad_geometry_is_a_config_error(patch, needle):
    with pytest.raises(ConfigError, match=needle):
        synth.validate_geometry({**tiny_geometry("deepseek-v3-small"), **patch})


def test_presets_are_listed_with_their_parameter_counts():
    rows = {r["name"]: r for r in synth.describe_presets()}
    for preset in SCALED:
        assert rows[preset]["materializable"]
        g = synth.validate_geometry(synth.load_preset(preset))
        # Parameters as written: an MXFP4 block byte holds two, scales are not parameters.
        planned = sum(torch.Size(t.shape).numel() * (2 if t.kind == "mx_blocks" else 1)
                      for unit in synth.tensor_plan(g) for t in unit if t.kind != "mx_scales")
        assert rows[preset]["total_params"] == planned, preset
