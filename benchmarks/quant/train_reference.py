"""Train the small *trained* qwen3_moe that quantization quality is measured on (or, --mtp, a glm4_moe
with a multi-token-prediction module that speculative decoding drafts with).

    nice -n 10 python benchmarks/quant/train_reference.py -o ../reference [--steps N] [--experts E] [--json]
        [--lock FILE] [--mtp [--mtp-weight 0.3]]

Random weights say little about quantization error (no outliers, near-uniform logits), so
this trains a real, if small, model: 4 layers, 16 experts top-4, hidden 256, a 4096-token
byte-level BPE (trained here with `tokenizers`), on text every CPython install has offline — the Python standard library's own
`.py` sources (this interpreter's `sysconfig` stdlib directory, test packages excluded; see
`engine/run/quality.py: stdlib_corpus`). One file in 20 (by a hash of its path) is held out.

Deterministic: fixed seeds, a fixed step count (not a time limit), one thread by default, files
in sorted order; same Python stdlib, tokenizers and torch → same weights. The training loop is
plain torch over the engine's own building blocks (rms_norm, rope, route), so the weights mean
what the engine computes (transformers' own MoE loop trained at ~100 tok/s here). One thread:
on a shared 2-core box torch's second thread cost ~10x more CPU per step than it saved.
`--experts 64` trains the same model with 64 experts per layer (top-4 still): its routed experts
are 96 MiB of bf16 against 6 MiB of dense weights, so under a few hundred MiB both bf16 and int8
must stream, as on the big models this tool is for (the default 16-expert model's int8 experts,
12 MiB, fit in any budget that holds torch). Defaults (700 steps x 8 x 128 tokens) take under 10
minutes of CPU here. Prints held-out
perplexity and writes an HF directory (config.json, model.safetensors in bf16, tokenizer.json).
--json prints the run's summary as the one row of a colibri.bench/1 document (benchkit.emit);
--lock FILE holds benchkit.bench_lock over the timed part (training and the held-out evaluation).

--mtp trains the reference benchmarks/time/draft_decode.py measures MTP drafting on: the same size in
GLM-4.5's structure (glm4_moe: partial rotary, qkv biases, a dense first layer, sigmoid routing with
DeepSeek-V3's auxiliary-loss-free bias, one shared expert) plus one MTP module trained with
DeepSeek-V3's objective: the module reads the main model's final hidden state at j and the embedding
of token j+1 (embedding and head shared with the main model; its own enorm, hnorm, eh_proj, decoder
layer and head norm) and predicts token j+2; loss = next-token loss + lambda (--mtp-weight, 0.3) x
the MTP module's, whose gradient also reaches the main model. Saved as GLM-4.5 / DeepSeek-V3 publish
it, layer num_hidden_layers with num_nextn_predict_layers 1 (engine/arch/mtp.py), which the engine's
MTP drafter loads. Default 300 steps (a few minutes of one core); also prints the MTP module's
held-out top-1 accuracy on the token after next. A short run's main model falls into greedy loops
(repeated newlines) on long prompts, which an MTP module trained on real text does not predict;
`--steps 700` (the qwen3_moe default) loops less, and its MTP drafts are accepted far more often. tests/test_train_reference_mtp.py checks that the
engine computes what this trains.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.api import stdlib_corpus  # noqa: E402
from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions  # noqa: E402

TOOL = "train_reference"

CONFIG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=4096, hidden_size=256,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
              num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=512, norm_topk_prob=True,
              max_position_embeddings=1024, rope_theta=10000.0, rope_parameters={"rope_type": "default",
              "rope_theta": 10000.0}, tie_word_embeddings=False, mlp_only_layers=[], decoder_sparse_step=1,
              rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, bos_token_id=0, eos_token_id=0,
              torch_dtype="bfloat16", dtype="bfloat16")
AUX_LOSS = 0.01  # Switch-style load balancing, so all 16 experts are trained and used

# --mtp: the same size in GLM-4.5's structure (glm4_moe, the MTP architecture nearest qwen3_moe:
# grouped-query attention, no MLA) with one MTP module, as GLM-4.5 publishes its
# num_nextn_predict_layers. Its first layer is dense, as GLM's; one group of experts (n_group 1).
MTP_CONFIG = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=4096, hidden_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=256,
                  intermediate_size=512, first_k_dense_replace=1, n_group=1, topk_group=1,
                  routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5, use_qk_norm=True,
                  attention_bias=True, num_nextn_predict_layers=1, max_position_embeddings=1024,
                  rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=0, eos_token_id=0,
                  torch_dtype="bfloat16", dtype="bfloat16")
MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the MTP loss (0.3 for its first 10T tokens)
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed gamma (0.001)
MTP_STEPS = 300  # --mtp's default: a few minutes of one core (the MTP module is a fifth layer and a head)


def train_tokenizer(train_text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<|endoftext|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([train_text[i:i + 100_000] for i in range(0, len(train_text), 100_000)], trainer)
    return tok


class Reference(torch.nn.Module):
    """The model in training form: the engine's own building blocks (engine/arch/model.py: rms_norm,
    rope, route, the architecture's router), so the trained weights mean exactly what the engine
    computes; experts stacked per layer [E, I, H] so the sparse loop indexes instead of looking up
    16 modules.

    qwen3_moe (CONFIG): softmax top-k routing, every layer MoE.
    glm4_moe (MTP_CONFIG, --mtp): GLM-4.5's layer as the engine runs it (engine/arch/families/
    glm4_moe.py: partial rotary, per-head q/k norms, qkv biases, a dense first layer, sigmoid routing
    with e_score_correction_bias, one shared expert) and one multi-token-prediction module after the
    last layer, as DeepSeek-V3's MTP objective trains it and engine/arch/mtp.py runs it:

        e = enorm(embed(t[j+1]))  (zero at row 0, as the engine and vLLM feed it)   [B, T-1, H]
        h = hnorm(hidden[j])      (the main model's final hidden state, after its norm)
        x = decoder_layer(eh_proj(cat(e, h)))  (its own attention over rows 0..j, an MoE block)
        mtp_logits = lm_head(shared_head_norm(x))   row j predicts t[j+2]

    with the embedding and lm_head shared with the main model (the saved file carries copies under
    the MTP layer's own names, as published)."""

    def __init__(self, c: dict):
        super().__init__()
        from engine.api import model_args
        from engine.api.lab import rope_inv_freq
        self.args = model_args(c)
        a = self.args
        H, V = a.hidden_size, a.vocab_size
        self.sigmoid_routing = a.router is not None  # glm4_moe: the architecture's SigmoidGroupRouter
        self.embed, self.lm_head, self.norm = self._p(V, H), self._p(V, H), self._ones(H)
        self.layers = torch.nn.ModuleList(self._layer(a.is_moe_layer(i)) for i in range(a.num_layers))
        self.mtp = None
        if int(c.get("num_nextn_predict_layers") or 0):
            self.mtp = self._layer(True)
            self.mtp.enorm, self.mtp.hnorm, self.mtp.head_norm = self._ones(H), self._ones(H), self._ones(H)
            self.mtp.eh_proj = self._p(H, 2 * H)
        self.inv_freq, self.rope_scale = rope_inv_freq(a)

    @staticmethod
    def _p(*shape, std=0.02):
        return torch.nn.Parameter(torch.randn(*shape) * std)

    @staticmethod
    def _ones(n):
        return torch.nn.Parameter(torch.ones(n))

    def _layer(self, moe: bool) -> torch.nn.Module:
        """One decoder layer's parameters (qwen3_moe: in the order the first reference drew them,
        so its seeded weights are unchanged)."""
        a, P, depth = self.args, self._p, math.sqrt(2 * self.args.num_layers)
        H, D, E, I = a.hidden_size, a.head_dim, a.num_experts, a.moe_intermediate_size
        m = torch.nn.Module()
        m.ln1, m.ln2, m.q_norm, m.k_norm = self._ones(H), self._ones(H), self._ones(D), self._ones(D)
        m.q, m.k, m.v = P(a.num_heads * D, H), P(a.num_kv_heads * D, H), P(a.num_kv_heads * D, H)
        m.o = P(H, a.num_heads * D, std=0.02 / depth)
        if a.attention_bias:
            m.q_bias, m.k_bias, m.v_bias = (torch.nn.Parameter(torch.zeros(n))
                                            for n in (a.num_heads * D, a.num_kv_heads * D, a.num_kv_heads * D))
        if not moe:  # a dense layer (glm4_moe's first_k_dense_replace)
            m.gate, m.up = P(a.intermediate_size, H), P(a.intermediate_size, H)
            m.down = P(H, a.intermediate_size, std=0.02 / depth)
            return m
        m.router = P(E, H)
        m.gate, m.up = P(E, I, H), P(E, I, H)
        m.down = P(E, H, I, std=0.02 / depth)
        if self.sigmoid_routing:
            # DeepSeek-V3's auxiliary-loss-free balancing: a bias on the choice only, moved after
            # each step towards the under-loaded experts (balance_routing), not by the gradient.
            m.register_buffer("bias", torch.zeros(E))
            m.load = torch.zeros(E)
        Is = a.shared_experts_intermediate_size
        if Is:
            m.shared_gate, m.shared_up = P(Is, H), P(Is, H)
            m.shared_down = P(H, Is, std=0.02 / depth)
        return m

    def _route(self, m, h: torch.Tensor):
        """h [N, H] → ids [N, K], weights [N, K], router probabilities [N, E] (the balance loss's)."""
        from engine.api.lab import route
        a = self.args
        if not self.sigmoid_routing:
            return *route(a, m.router, h), torch.softmax(h @ m.router.T, dim=-1)
        ids, weights = a.router.route({"r.mlp.gate.weight": m.router, "r.mlp.gate.e_score_correction_bias": m.bias},
                                      "r", h)
        with torch.no_grad():
            m.load = m.load + torch.bincount(ids.reshape(-1), minlength=a.num_experts).float()
        scores = torch.sigmoid(h @ m.router.T)
        return ids, weights, scores / scores.sum(-1, keepdim=True)

    def _block(self, m, x: torch.Tensor, cos, sin):
        """x [B, T, H] → (x after attention and the MLP or MoE, the layer's balance loss)."""
        from engine.api.lab import apply_rope, rms_norm
        a = self.args
        B, T, _ = x.shape
        h = rms_norm(x, m.ln1, a.rms_norm_eps)
        bias = (lambda n: getattr(m, n + "_bias")) if a.attention_bias else (lambda n: 0)  # noqa: E731
        q = (h @ m.q.T + bias("q")).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = (h @ m.k.T + bias("k")).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = (h @ m.v.T + bias("v")).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(rms_norm(q, m.q_norm, a.rms_norm_eps), cos, sin), \
            apply_rope(rms_norm(k, m.k_norm, a.rms_norm_eps), cos, sin)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + att.transpose(1, 2).reshape(B, T, -1) @ m.o.T
        h = rms_norm(x, m.ln2, a.rms_norm_eps).reshape(B * T, -1)
        if not hasattr(m, "router"):
            return x + self._swiglu(h, m.gate, m.up, m.down).view(B, T, -1), 0.0
        ids, weights, probs = self._route(m, h)  # [N, K], [N, K], [N, E]
        share = torch.zeros(a.num_experts).index_add_(0, ids.reshape(-1), torch.ones(ids.numel())) / ids.numel()
        aux = a.num_experts * (share * probs.mean(0)).sum()
        out = torch.zeros_like(h)
        for e in range(a.num_experts):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                y = self._swiglu(h[tok], m.gate[e], m.up[e], m.down[e])
                out = out.index_add(0, tok, y * weights[tok, slot, None])
        if hasattr(m, "shared_gate"):
            out = out + self._swiglu(h, m.shared_gate, m.shared_up, m.shared_down)
        return x + out.view(B, T, -1), aux

    @staticmethod
    def _swiglu(x, gate, up, down):
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def forward(self, tokens: torch.Tensor, mtp: bool = False):
        """tokens [B, T] → logits [B, T, V], the mean balance loss, and (mtp, with an MTP module) the
        MTP module's logits [B, T-1, V] (row j reads tokens[:, j+1] and predicts the token after it)
        else None."""
        hidden, aux, moe_layers = self.trunk(tokens)
        logits = hidden @ self.lm_head.T
        if not (mtp and self.mtp is not None):
            return logits, aux / moe_layers, None
        logits_mtp, mtp_aux = self.mtp_forward(tokens[:, 1:], hidden[:, :-1])
        return logits, (aux + mtp_aux) / (moe_layers + 1), logits_mtp

    def trunk(self, tokens: torch.Tensor):
        """tokens [B, T] → (the final hidden state after the model's norm [B, T, H]: what lm_head and
        the MTP module read; the layers' summed balance loss; how many layers are MoE)."""
        from engine.api.lab import rms_norm
        x = torch.nn.functional.embedding(tokens, self.embed)
        cos, sin = self._rope(tokens.shape[1])
        aux, moe_layers = 0.0, 0
        for m in self.layers:
            x, layer_aux = self._block(m, x, cos, sin)
            aux, moe_layers = aux + layer_aux, moe_layers + hasattr(m, "router")
        return rms_norm(x, self.norm, self.args.rms_norm_eps), aux, moe_layers

    def _rope(self, T: int):
        from engine.api.lab import rope_cos_sin
        return rope_cos_sin(self.inv_freq, self.rope_scale, torch.arange(T), torch.float32)

    def mtp_forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor):
        """next_tokens [B, T] (t[j+1]), hidden [B, T, H] (the main model's at j), from position 0 →
        (logits [B, T, V], the MTP layer's balance loss): engine/arch/mtp.py's MtpLayer.forward."""
        from engine.api.lab import rms_norm
        a, m = self.args, self.mtp
        e = torch.nn.functional.embedding(next_tokens, self.embed)
        e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # position 0: no previous state
        x = torch.cat([rms_norm(e, m.enorm, a.rms_norm_eps), rms_norm(hidden, m.hnorm, a.rms_norm_eps)], -1)  # [B, T, 2H]
        x = x @ m.eh_proj.T
        x, aux = self._block(m, x, *self._rope(next_tokens.shape[1]))
        return rms_norm(x, m.head_norm, a.rms_norm_eps) @ self.lm_head.T, aux

    @torch.no_grad()
    def balance_routing(self, rate: float) -> None:
        """DeepSeek-V3's bias update: each expert's choice bias moves by `rate` towards the mean load
        of the steps since the last call (sigmoid routing only)."""
        for m in [*self.layers, self.mtp]:
            if m is not None and hasattr(m, "bias"):
                m.bias += rate * torch.sign(m.load.mean() - m.load)
                m.load = torch.zeros_like(m.load)

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Weights under the names save_pretrained writes (Qwen3MoeForCausalLM, Glm4MoeForCausalLM;
        the MTP module as layer num_hidden_layers, DeepSeek-V3's published layout)."""
        out = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head, "model.norm.weight": self.norm}
        for i, m in enumerate(self.layers):
            out.update(self._layer_tensors(f"model.layers.{i}", m))
        if self.mtp is not None:
            p, m = f"model.layers.{self.args.num_layers}", self.mtp
            out.update(self._layer_tensors(p, m))
            out.update({f"{p}.embed_tokens.weight": self.embed, f"{p}.enorm.weight": m.enorm,
                        f"{p}.hnorm.weight": m.hnorm, f"{p}.eh_proj.weight": m.eh_proj,
                        f"{p}.shared_head.norm.weight": m.head_norm, f"{p}.shared_head.head.weight": self.lm_head})
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}

    def _layer_tensors(self, p: str, m) -> dict[str, torch.Tensor]:
        out = {f"{p}.input_layernorm.weight": m.ln1, f"{p}.post_attention_layernorm.weight": m.ln2,
               f"{p}.self_attn.q_proj.weight": m.q, f"{p}.self_attn.k_proj.weight": m.k,
               f"{p}.self_attn.v_proj.weight": m.v, f"{p}.self_attn.o_proj.weight": m.o,
               f"{p}.self_attn.q_norm.weight": m.q_norm, f"{p}.self_attn.k_norm.weight": m.k_norm}
        if self.args.attention_bias:
            out.update({f"{p}.self_attn.{n}_proj.bias": getattr(m, n + "_bias") for n in "qkv"})
        if not hasattr(m, "router"):
            out.update({f"{p}.mlp.gate_proj.weight": m.gate, f"{p}.mlp.up_proj.weight": m.up,
                        f"{p}.mlp.down_proj.weight": m.down})
            return out
        out[f"{p}.mlp.gate.weight"] = m.router
        if hasattr(m, "bias"):
            out[f"{p}.mlp.gate.e_score_correction_bias"] = m.bias
        if hasattr(m, "shared_gate"):
            out.update({f"{p}.mlp.shared_experts.gate_proj.weight": m.shared_gate,
                        f"{p}.mlp.shared_experts.up_proj.weight": m.shared_up,
                        f"{p}.mlp.shared_experts.down_proj.weight": m.shared_down})
        for e in range(self.args.num_experts):
            for name, t in (("gate_proj", m.gate[e]), ("up_proj", m.up[e]), ("down_proj", m.down[e])):
                out[f"{p}.mlp.experts.{e}.{name}.weight"] = t
        return out


def batches(ids: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int, max_tokens: int) -> dict:
    """Held-out perplexity of the next token; with an MTP module, also top-1 accuracy of the next
    token and of the MTP module's token after next (the chance a greedy MTP draft is accepted
    where the main model predicts the next token right)."""
    nll, n, top1, mtp_top1, mtp_n = 0.0, 0, 0, 0, 0
    for s in range(0, min(ids.numel() - 1, max_tokens) - seq, seq):
        chunk = ids[s:s + seq + 1][None]
        logits, _, logits_mtp = model(chunk[:, :-1], mtp=True)
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        top1 += int((logits[0].argmax(-1) == chunk[0, 1:]).sum())
        n += seq
        if logits_mtp is not None:  # row j predicts chunk[j + 2]
            mtp_top1 += int((logits_mtp[0].argmax(-1) == chunk[0, 2:]).sum())
            mtp_n += seq - 1
    return {"ppl": math.exp(nll / max(n, 1)), "top1": top1 / max(n, 1),
            "mtp_top1": mtp_top1 / mtp_n if mtp_n else None}


def save(model: Reference, tok, out_dir: Path, config: dict) -> None:
    from engine.api.lab import ShardWriter, TensorSpec, write_json_atomic
    tmp = out_dir.parent / (out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = model.hf_tensors()
    specs = [TensorSpec(n, tuple(t.shape), "bfloat16") for n, t in tensors.items()]
    with ShardWriter(tmp / "model.safetensors", specs) as w:
        for n, t in tensors.items():
            w.write(n, t)
    write_json_atomic(tmp / "config.json", config)
    tok.save(str(tmp / "tokenizer.json"))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", required=True, help="output HF directory (replaced)")
    p.add_argument("--steps", type=int, default=None, help=f"default 700; with --mtp {MTP_STEPS}")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=CONFIG["num_experts"],
                   help="routed experts per layer (top-4 of them per token)")
    p.add_argument("--mtp", action="store_true",
                   help="train glm4_moe with one MTP module (DeepSeek-V3's objective) instead of qwen3_moe")
    p.add_argument("--mtp-weight", type=float, default=MTP_WEIGHT, help=f"the MTP loss's lambda (default {MTP_WEIGHT})")
    p.add_argument("--eval-tokens", type=int, default=16384)
    add_output_flags(p)
    a = p.parse_args()
    steps = a.steps if a.steps is not None else MTP_STEPS if a.mtp else 700
    if steps < 1 or a.seq < 2 or a.batch < 1 or a.experts < 4 or a.threads < 1 or a.mtp_weight < 0:
        print(f"{TOOL}: error: --steps, --batch, --threads positive, --seq >= 2, --experts >= 4 (top-4), "
              f"--mtp-weight >= 0", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    log = lambda *m: print(*m, file=sys.stderr, flush=True)  # noqa: E731
    t0, cpu0 = time.perf_counter(), time.process_time()
    train_text, held_text, corpus = stdlib_corpus()
    tok = train_tokenizer(train_text)
    train_ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
    log(f"corpus: {corpus['files_train']} train files ({train_ids.numel()} tokens), {corpus['files_held']} held-out "
        f"({held_ids.numel()} tokens); tokenizer {time.perf_counter() - t0:.0f} s")

    config = dict(MTP_CONFIG, n_routed_experts=a.experts) if a.mtp else dict(CONFIG, num_experts=a.experts)
    model = Reference(config)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warmup = max(steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    held = contextlib.ExitStack()  # the timed part holds the bench lock (--lock), through the evaluation
    held.enter_context(bench_lock(a.lock))
    t_train, cpu_train = time.perf_counter(), time.process_time()
    for step, batch in enumerate(batches(train_ids, a.seq, a.batch, steps, a.seed), 1):
        logits, aux, logits_mtp = model(batch[:, :-1], mtp=a.mtp)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        total = loss + AUX_LOSS * aux
        if logits_mtp is not None:  # row j (t[j+1] and the state at j) predicts batch[:, j + 2]
            mtp_loss = torch.nn.functional.cross_entropy(logits_mtp.reshape(-1, logits_mtp.shape[-1]),
                                                         batch[:, 2:].reshape(-1))
            total = total + a.mtp_weight * mtp_loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.balance_routing(BIAS_RATE)
        if step % 25 == 0 or step == steps:
            el = time.perf_counter() - t_train
            mtp_part = f"  mtp {mtp_loss.item():.3f}" if logits_mtp is not None else ""
            log(f"step {step}/{steps}  loss {loss.item():.3f}{mtp_part}  aux {float(aux.detach()):.3f}  "
                f"{el:.0f} s wall, "
                f"{time.process_time() - cpu_train:.0f} s CPU  ({step * a.batch * a.seq / el:.0f} tok/s)")
    train_s, train_cpu = time.perf_counter() - t_train, time.process_time() - cpu_train
    held_eval = perplexity(model, held_ids, 256, a.eval_tokens)
    held_ppl = held_eval["ppl"]
    held.close()
    save(model, tok, Path(a.out), config)
    summary = {"out": a.out, "config": config, "steps": steps, "seq": a.seq, "batch": a.batch,
               "train_tokens_seen": steps * a.seq * a.batch, "train_wall_s": round(train_s, 1),
               "train_cpu_s": round(train_cpu, 1), "total_wall_s": round(time.perf_counter() - t0, 1),
               "threads": a.threads, "held_out_ppl_fp32": round(held_ppl, 3), "eval_tokens": a.eval_tokens,
               "eval_ctx": 256, "corpus": corpus, "python": platform.python_version(), "torch": torch.__version__,
               "params": sum(q.numel() for q in model.parameters())}
    if a.mtp:
        summary.update(mtp_weight=a.mtp_weight, held_out_top1=round(held_eval["top1"], 4),
                       held_out_mtp_top1=round(held_eval["mtp_top1"], 4))
    if a.json:
        emit(TOOL, [summary], run_conditions(a, model=f"trained reference {config['model_type']}"), True, [])
    else:
        mtp_part = (f"; MTP module top-1 of the token after next {held_eval['mtp_top1']:.1%} (next token "
                    f"{held_eval['top1']:.1%})" if a.mtp else "")
        print(f"trained {summary['params'] / 1e6:.1f}M params ({config['model_type']}): {steps} steps x {a.batch} x "
              f"{a.seq} tokens, {train_s:.0f} s wall / {train_cpu:.0f} s CPU ({a.threads} threads); held-out "
              f"perplexity {held_ppl:.2f} (fp32, ctx 256, first {a.eval_tokens} held-out tokens){mtp_part}; corpus: "
              f"{corpus['description']}; wrote {a.out}")

if __name__ == "__main__":
    main()
