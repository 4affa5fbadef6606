"""Tiny random Hugging Face checkpoints built with transformers' own classes (no download).

transformers is the oracle only: tests import this module; the engine never does.
"""

from __future__ import annotations

from pathlib import Path

from engine.arch.registry import ARCHITECTURES

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2,
            tie_word_embeddings=False)

# Each architecture's own knobs (its record's `oracle`, engine/arch/families/), set so that every
# code path is exercised: experts of a different size from the dense MLP, a shared expert,
# mlp-only layers, q/k norms, qkv bias, the routers, attentions and RoPE scalings of each family.
ARCHS: dict[str, dict] = {t: cfg for a in ARCHITECTURES if a.oracle for t, cfg in a.oracle.configs.items()}

# transformers initialises biases, attention sinks and the routers' score-correction bias to
# zero; these architectures get them random before saving (TinyOracle.randomize_zeros).
RANDOMIZED_ZEROS = tuple(t for a in ARCHITECTURES if a.oracle and a.oracle.randomize_zeros for t in a.oracle.configs)


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


def built_once(tmp_path_factory, name: str):
    """get(model_type) → the directory of a tiny `model_type` checkpoint, built on first use under a
    fresh `name` folder (a module fixture returns this, so each module builds each architecture once)."""
    root = tmp_path_factory.mktemp(name)
    made = {}

    def get(model_type: str):
        if model_type not in made:
            made[model_type] = root / model_type
            build(model_type, made[model_type])
        return made[model_type]
    return get
