"""benchmarks/quant/train_reference.py --mtp: the glm4_moe it trains, with its MTP module, is saved in
the layout the engine loads (the MTP module as layer num_hidden_layers, DeepSeek-V3's names), and the
engine computes what training computed: the main model's logits and the MTP module's, and the
engine's own pairing of a token with the hidden state before it (engine/run/mtp_drafter.py) drafts
the token the training forward predicts. A tiny model, random weights with every norm and bias
perturbed (so a swapped or misnamed tensor shows), rounded to bf16 before the comparison so the file
holds exactly what training used; the engine runs fp32."""

from __future__ import annotations

import torch

from benchmarks.quant import train_reference as tr
from engine.base.config import EngineConfig
from engine.run.runtime import Engine

TINY = dict(tr.MTP_CONFIG, vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            intermediate_size=48, max_position_embeddings=64)
TOKENS = [(7 * i + 3) % 96 for i in range(20)]


class _NoTokenizer:
    def save(self, path: str) -> None:  # the engine's forward needs no tokenizer.json
        pass


def _trained_like(seed: int = 0) -> tr.Reference:
    torch.manual_seed(seed)
    model = tr.Reference(TINY)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms at 1 and biases at 0 would hide a swapped or dropped tensor
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(5.0)  # std 0.1: logits far enough apart that fp32 op order never flips an argmax
        for m in [*model.layers, model.mtp]:
            if hasattr(m, "bias"):
                m.bias.copy_(0.1 * torch.randn_like(m.bias))
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(t.to(torch.bfloat16).float())  # what the file holds
    return model


def _engine(d, **kw):
    return Engine(d, EngineConfig(ctx_size=64, threads=1, dtype="fp32", **kw))


def test_the_saved_mtp_module_is_the_engines_and_computes_the_training_forward(tmp_path):
    model = _trained_like()
    tr.save(model, _NoTokenizer(), tmp_path / "ref", TINY)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits, _, logits_mtp = model(tokens[None], mtp=True)
        hidden, _, _ = model.trunk(tokens[None])
    L = TINY["num_hidden_layers"]
    with _engine(tmp_path / "ref", draft="fixed", drafter="mtp", draft_depth=2) as e:
        assert e.mtp is not None and e.mtp.layer.layer == L
        torch.testing.assert_close(e.forward(TOKENS, 0), logits[0], rtol=1e-4, atol=1e-4)
        got, _ = e.mtp.layer.forward(tokens[1:], hidden[0, :-1], 0)
        torch.testing.assert_close(got, logits_mtp[0], rtol=1e-4, atol=1e-4)


def test_the_engines_mtp_draft_is_the_training_forwards_prediction(tmp_path):
    """A prompt prefilled, then the next token: the MTP draft reads (that token, the prompt's last hidden
    state), the pair training's row len(prompt) - 1 reads."""
    model = _trained_like(seed=1)
    tr.save(model, _NoTokenizer(), tmp_path / "ref", TINY)
    prompt, after = TOKENS[:-1], TOKENS[-1]
    with torch.no_grad():
        _, _, logits_mtp = model(torch.tensor(TOKENS)[None], mtp=True)
    with _engine(tmp_path / "ref", draft="fixed", drafter="mtp", draft_depth=1) as e:
        e.forward(prompt, 0, last_only=True)
        assert e.mtp.draft(1, after) == [int(logits_mtp[0, len(prompt) - 1].argmax())]


def test_qwen3_reference_keeps_its_layout_without_mtp(tmp_path):
    """The default reference is unchanged: qwen3_moe, no MTP module, loads and computes as trained."""
    cfg = dict(tr.CONFIG, vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, num_experts=4, moe_intermediate_size=16)
    torch.manual_seed(0)
    model = tr.Reference(cfg)
    with torch.no_grad():
        for t in model.parameters():
            t.copy_((t * (1 if t.dim() == 1 else 5)).to(torch.bfloat16).float())
        logits, _, none = model(torch.tensor(TOKENS)[None], mtp=True)
    assert model.mtp is None and none is None
    tr.save(model, _NoTokenizer(), tmp_path / "ref", cfg)
    with _engine(tmp_path / "ref") as e:
        torch.testing.assert_close(e.forward(TOKENS, 0), logits[0], rtol=1e-4, atol=1e-4)
