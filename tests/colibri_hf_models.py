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
    # The architectures with their own attention, routing and experts (engine/arch/families/).
    # Four groups of two with topk_group 2 make the group limit bite; dense first layer;
    # yarn with mscale_all_dim moves the softmax scale; rope_interleave is DeepSeek's default.
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1, head_dim=16, use_qk_norm=True, attention_bias=True,
                     routed_scaling_factor=1.5, n_group=2, topk_group=1),
    # index_topk 6 < the 32-token prompt, so the indexer's selection decides what is attended;
    # layer 2 reuses layer 1's selection.
    "glm_moe_dsa": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4, index_topk=6,
                        index_head_dim=16, index_n_heads=8, indexer_types=["full", "full", "shared"]),
    # sliding window 8 < the prompt; yarn as the published config (truncate=False).
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8, intermediate_size=32,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}


# transformers initialises biases, attention sinks and the routers' score-correction bias to
# zero; left so, a test could not tell "correction bias used for selection only" from "not used"
# or a missing bias from a present one. These architectures get them random before saving.
RANDOMIZED_ZEROS = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "gpt_oss")


def randomize_zero_tensors(model, std: float = 0.3) -> None:
    import torch
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            last = name.rsplit(".", 1)[-1]
            if (last in ("bias", "sinks", "e_score_correction_bias") or last.endswith("_bias")) and not t.any():
                t.normal_(0.0, std)


def build(model_type: str, out_dir: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a tiny random `model_type` checkpoint into out_dir and return the transformers model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **ARCHS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    if model_type in RANDOMIZED_ZEROS:
        randomize_zero_tensors(model)
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


# --- the oracle checks the architecture suites share (test_archs.py, test_fp8.py) ---------------

ATOL = 1e-4  # fp32, max |logit difference| (test_oracle.py's rule)
PROMPT = [(7 * i + 3) % 256 for i in range(32)]


def fp32_engine(d, **kw):
    from engine.base.config import EngineConfig
    from engine.run.runtime import Engine
    return Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1, **kw))


def assert_logits_match(d, model, label: str, prompt: list[int] = PROMPT, atol: float = ATOL) -> float:
    """The engine on directory d against transformers' `model`: max |dlogit| over the prompt."""
    with fp32_engine(d) as engine:
        diff = (engine.forward(prompt, 0) - hf_logits(model, prompt)).abs().max().item()
    print(f"{label}: max |dlogit| = {diff:.3e}")
    assert diff <= atol, f"{label}: max |dlogit| {diff:.3e} > {atol}"
    return diff


def assert_greedy_match(d, model, n: int = 16, prompt: list[int] = PROMPT) -> None:
    from engine.run.generate import Sampler, generate
    with fp32_engine(d) as engine:
        assert generate(engine, prompt, n, Sampler()).output_ids == hf_greedy(model, prompt, n)
