"""Train the small *trained* qwen3_moe that quantization quality is measured on.

    nice -n 10 python benchmarks/train_reference.py -o /work/scratch/quant/reference [--steps N] [--json]

Random weights say little about quantization error (no outliers, near-uniform logits), so
this trains a real, if small, model: 4 layers, 16 experts top-4, hidden 256, a 4096-token
byte-level BPE, on text every CPython install has offline — the Python standard library's own
`.py` sources (this interpreter's `sysconfig` stdlib directory, test packages excluded; see
`tuner/quality.py: stdlib_corpus`). One file in 20 (by a hash of its path) is held out.

Deterministic: fixed seeds, a fixed step count (not a time limit), a fixed thread count, files
in sorted order; same Python stdlib, torch and transformers → same weights. transformers is used
here only to train (as in tests); the engine never imports it. Prints held-out perplexity and
writes an HF directory (config.json, model.safetensors in bf16, tokenizer.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tuner.quality import stdlib_corpus  # noqa: E402

GEOMETRY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=512,
                norm_topk_prob=True, max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                mlp_only_layers=[], decoder_sparse_step=1, router_aux_loss_coef=0.01, output_router_logits=True,
                rms_norm_eps=1e-6)
VOCAB = 4096


def train_tokenizer(train_text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([train_text[i:i + 100_000] for i in range(0, len(train_text), 100_000)], trainer)
    return tok


def batches(ids: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq + 1] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq: int, max_tokens: int) -> float:
    model.eval()
    nll, n = 0.0, 0
    for s in range(0, min(ids.numel() - 1, max_tokens) - seq, seq):
        chunk = ids[s:s + seq + 1][None]
        logits = model(chunk[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        n += seq
    model.train()
    return math.exp(nll / max(n, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", required=True, help="output HF directory (replaced)")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    train_text, held_text, corpus_info = stdlib_corpus()
    tok = train_tokenizer(train_text)
    train_ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.long)
    held_ids = torch.tensor(tok.encode(held_text).ids, dtype=torch.long)
    log = lambda *m: print(*m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"corpus: {corpus_info['files_train']} train files ({train_ids.numel()} tokens), {corpus_info['files_held']} "
        f"held-out ({held_ids.numel()} tokens), tokenizer {time.perf_counter() - t0:.1f} s")

    config = Qwen3MoeConfig(vocab_size=VOCAB, eos_token_id=0, bos_token_id=0, **GEOMETRY)
    model = Qwen3MoeForCausalLM(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(a.steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    t_train = time.perf_counter()
    for step, batch in enumerate(batches(train_ids, a.seq, a.batch, a.steps, a.seed), 1):
        out = model(batch[:, :-1], labels=batch[:, :-1].clone(), output_router_logits=True)
        # HF shifts labels itself: labels = inputs, predicting input[t+1] from input[:t+1].
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == a.steps:
            el = time.perf_counter() - t_train
            log(f"step {step}/{a.steps}  loss {out.loss.item():.3f}  {el:.0f} s  ({step * a.batch * a.seq / el:.0f} tok/s)")
    train_s = time.perf_counter() - t_train
    held_ppl = perplexity(model, held_ids, a.seq * 2, a.eval_tokens)
    train_ppl = perplexity(model, train_ids, a.seq * 2, a.eval_tokens)

    out_dir = Path(a.out)
    tmp = out_dir.parent / (out_dir.name + ".partial")
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(tmp)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tmp)
    import shutil
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    summary = {"out": str(out_dir), "geometry": GEOMETRY, "vocab": VOCAB, "steps": a.steps, "seq": a.seq,
               "batch": a.batch, "train_tokens_seen": a.steps * a.seq * a.batch, "train_seconds": round(train_s, 1),
               "threads": a.threads, "held_out_ppl_fp32": round(held_ppl, 3), "train_ppl_fp32": round(train_ppl, 3),
               "eval_tokens": a.eval_tokens, "eval_ctx": a.seq * 2, "corpus": corpus_info,
               "python": platform.python_version(), "torch": torch.__version__,
               "params": sum(p.numel() for p in model.parameters())}
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"trained {summary['params'] / 1e6:.1f}M params, {a.steps} steps x {a.batch} x {a.seq} tokens in "
              f"{train_s:.0f} s ({a.threads} threads): held-out perplexity {held_ppl:.2f} (train {train_ppl:.2f}), "
              f"fp32, ctx {a.seq * 2}, {a.eval_tokens} tokens; corpus: {corpus_info['description']}; wrote {out_dir}")


if __name__ == "__main__":
    main()
