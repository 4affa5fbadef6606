"""Tiny random Hugging Face checkpoints built with transformers' own classes (no download).

transformers is the oracle only: tests import this module; the engine never does.
"""

from __future__ import annotations

from pathlib import Path

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2,
            tie_word_embeddings=False)

# Each architecture's own knobs, set so that every code path is exercised: experts of a
# different size from the dense MLP, a shared expert, mlp-only layers, q/k norms, qkv bias.
ARCHS: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=16, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0),
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen3": dict(head_dim=16, max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 64}),
}


def build(model_type: str, out_dir: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a tiny random `model_type` checkpoint into out_dir and return the transformers model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **ARCHS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    save = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save)
    return model


def hf_logits(model, ids: list[int]):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch
    seq = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
    return out
