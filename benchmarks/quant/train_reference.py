"""Train the small *trained* qwen3_moe that quantization quality is measured on.

    nice -n 10 python benchmarks/quant/train_reference.py -o ../reference [--steps N] [--experts E] [--json]
        [--lock FILE]

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
    """qwen3_moe in training form: the engine's own building blocks (engine/arch/model.py: rms_norm,
    rope, route), so the trained weights mean exactly what the engine computes; experts stacked
    per layer [E, I, H] so the sparse loop indexes instead of looking up 16 modules."""

    def __init__(self, c: dict):
        super().__init__()
        from engine.api import model_args
        from engine.api.lab import rope_inv_freq
        self.args = model_args(c)
        a = self.args
        H, D, E, I, V = a.hidden_size, a.head_dim, a.num_experts, a.moe_intermediate_size, a.vocab_size
        P = lambda *shape, std=0.02: torch.nn.Parameter(torch.randn(*shape) * std)  # noqa: E731
        ones = lambda n: torch.nn.Parameter(torch.ones(n))  # noqa: E731
        self.embed, self.lm_head, self.norm = P(V, H), P(V, H), ones(H)
        self.layers = torch.nn.ModuleList()
        for _ in range(a.num_layers):
            m = torch.nn.Module()
            m.ln1, m.ln2, m.q_norm, m.k_norm = ones(H), ones(H), ones(D), ones(D)
            m.q, m.k, m.v = P(a.num_heads * D, H), P(a.num_kv_heads * D, H), P(a.num_kv_heads * D, H)
            m.o = P(H, a.num_heads * D, std=0.02 / math.sqrt(2 * a.num_layers))
            m.router = P(E, H)
            m.gate, m.up = P(E, I, H), P(E, I, H)
            m.down = P(E, H, I, std=0.02 / math.sqrt(2 * a.num_layers))
            self.layers.append(m)
        self.inv_freq, self.rope_scale = rope_inv_freq(a)

    def forward(self, tokens: torch.Tensor):
        """tokens [B, T] → logits [B, T, V], load-balancing loss."""
        from engine.api.lab import apply_rope, rope_cos_sin
        from engine.api.lab import rms_norm, route
        a = self.args
        B, T = tokens.shape
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, torch.arange(T), torch.float32)
        x = torch.nn.functional.embedding(tokens, self.embed)
        aux = 0.0
        for m in self.layers:
            h = rms_norm(x, m.ln1, a.rms_norm_eps)
            q = (h @ m.q.T).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
            k = (h @ m.k.T).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
            v = (h @ m.v.T).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
            q, k = apply_rope(rms_norm(q, m.q_norm, a.rms_norm_eps), cos, sin), \
                apply_rope(rms_norm(k, m.k_norm, a.rms_norm_eps), cos, sin)
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ m.o.T
            h = rms_norm(x, m.ln2, a.rms_norm_eps).reshape(B * T, -1)
            ids, weights = route(a, m.router, h)  # [N, K]
            probs = torch.softmax(h @ m.router.T, dim=-1)
            share = torch.zeros(a.num_experts).index_add_(0, ids.reshape(-1), torch.ones(ids.numel())) / ids.numel()
            aux = aux + a.num_experts * (share * probs.mean(0)).sum()
            out = torch.zeros_like(h)
            for e in range(a.num_experts):
                tok, slot = torch.where(ids == e)
                if tok.numel():
                    xe = h[tok]
                    y = (torch.nn.functional.silu(xe @ m.gate[e].T) * (xe @ m.up[e].T)) @ m.down[e].T
                    out = out.index_add(0, tok, y * weights[tok, slot, None])
            x = x + out.view(B, T, -1)
        return rms_norm(x, self.norm, a.rms_norm_eps) @ self.lm_head.T, aux / a.num_layers

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Weights under the names save_pretrained writes for Qwen3MoeForCausalLM."""
        out = {"model.embed_tokens.weight": self.embed, "lm_head.weight": self.lm_head, "model.norm.weight": self.norm}
        for i, m in enumerate(self.layers):
            p = f"model.layers.{i}"
            out.update({f"{p}.input_layernorm.weight": m.ln1, f"{p}.post_attention_layernorm.weight": m.ln2,
                        f"{p}.self_attn.q_proj.weight": m.q, f"{p}.self_attn.k_proj.weight": m.k,
                        f"{p}.self_attn.v_proj.weight": m.v, f"{p}.self_attn.o_proj.weight": m.o,
                        f"{p}.self_attn.q_norm.weight": m.q_norm, f"{p}.self_attn.k_norm.weight": m.k_norm,
                        f"{p}.mlp.gate.weight": m.router})
            for e in range(self.args.num_experts):
                for name, t in (("gate_proj", m.gate[e]), ("up_proj", m.up[e]), ("down_proj", m.down[e])):
                    out[f"{p}.mlp.experts.{e}.{name}.weight"] = t
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def batches(ids: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int, max_tokens: int) -> float:
    nll, n = 0.0, 0
    for s in range(0, min(ids.numel() - 1, max_tokens) - seq, seq):
        chunk = ids[s:s + seq + 1][None]
        logits, _ = model(chunk[:, :-1])
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n += seq
    return math.exp(nll / max(n, 1))


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
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=CONFIG["num_experts"],
                   help="routed experts per layer (top-4 of them per token)")
    p.add_argument("--eval-tokens", type=int, default=16384)
    add_output_flags(p)
    a = p.parse_args()
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

    config = dict(CONFIG, num_experts=a.experts)
    model = Reference(config)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    warmup = max(a.steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))))
    held = contextlib.ExitStack()  # the timed part holds the bench lock (--lock), through the evaluation
    held.enter_context(bench_lock(a.lock))
    t_train, cpu_train = time.perf_counter(), time.process_time()
    for step, batch in enumerate(batches(train_ids, a.seq, a.batch, a.steps, a.seed), 1):
        logits, aux = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        (loss + AUX_LOSS * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == a.steps:
            el = time.perf_counter() - t_train
            log(f"step {step}/{a.steps}  loss {loss.item():.3f}  aux {float(aux.detach()):.3f}  {el:.0f} s wall, "
                f"{time.process_time() - cpu_train:.0f} s CPU  ({step * a.batch * a.seq / el:.0f} tok/s)")
    train_s, train_cpu = time.perf_counter() - t_train, time.process_time() - cpu_train
    held_ppl = perplexity(model, held_ids, 256, a.eval_tokens)
    held.close()
    save(model, tok, Path(a.out), config)
    summary = {"out": a.out, "config": config, "steps": a.steps, "seq": a.seq, "batch": a.batch,
               "train_tokens_seen": a.steps * a.seq * a.batch, "train_wall_s": round(train_s, 1),
               "train_cpu_s": round(train_cpu, 1), "total_wall_s": round(time.perf_counter() - t0, 1),
               "threads": a.threads, "held_out_ppl_fp32": round(held_ppl, 3), "eval_tokens": a.eval_tokens,
               "eval_ctx": 256, "corpus": corpus, "python": platform.python_version(), "torch": torch.__version__,
               "params": sum(q.numel() for q in model.parameters())}
    if a.json:
        emit(TOOL, [summary], run_conditions(a, model="trained reference qwen3_moe"), True, [])
    else:
        print(f"trained {summary['params'] / 1e6:.1f}M params: {a.steps} steps x {a.batch} x {a.seq} tokens, "
              f"{train_s:.0f} s wall / {train_cpu:.0f} s CPU ({a.threads} threads); held-out perplexity "
              f"{held_ppl:.2f} (fp32, ctx 256, first {a.eval_tokens} held-out tokens); corpus: "
              f"{corpus['description']}; wrote {a.out}")


if __name__ == "__main__":
    main()
