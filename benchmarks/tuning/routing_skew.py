"""How far `--routing-skew` moves synthetic routing from uniform towards real MoE routing.

For each skew value: synthesize a model (a preset's geometry, optionally with fewer layers),
load it with transformers (the reference implementation, so the figures do not depend on our
engine), record every layer's routed expert set per token, and print per skew:

  top10%   share of all routings that go to the 10% most-used experts of a layer
  reuse    mean |S_t ∩ S_{t-1}| / k: how much of the previous token's expert set the next token reuses
  reuse@32 the same against the token 32 positions back: the share popularity alone explains
  LRU@N    hit rate of a per-layer LRU expert cache with N slots, fed the tokens in order

Two workloads: teacher-forced prompts of random token ids, and sampled generation (temperature 1)
from a short random prompt. References: uniform random top-k; real OLMoE LRU 28/54/68/79% at
8/16/24/32 slots; GLM-5 reuse ~41% (docs/SYNTH.md, shared notes ANCHORS.md).

  .venv/bin/python benchmarks/tuning/routing_skew.py --preset demo --layers 4 --skews 0,0.5,1,2
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SLOTS = (8, 16, 24, 32)
FAR = 32  # overlap with the token this far back: what popularity alone gives, without locality


def routing_stats(seqs: list[list[list[int]]], num_experts: int, k: int) -> dict:
    """seqs[s][t] = expert ids chosen for token t of sequence s (one layer). Caches restart per sequence."""
    counts = [0] * num_experts
    reuse_sum, reuse_n = 0.0, 0
    far_sum, far_n = 0.0, 0
    hits = {n: 0 for n in SLOTS}
    accesses = 0
    for seq in seqs:
        caches: dict[int, dict[int, None]] = {n: {} for n in SLOTS}  # insertion-ordered dict = LRU
        prev = None
        for t, experts in enumerate(seq):
            if t >= FAR:
                far_sum += len(set(experts) & set(seq[t - FAR])) / k
                far_n += 1
            for e in experts:
                counts[e] += 1
            if prev is not None:
                reuse_sum += len(set(experts) & prev) / k
                reuse_n += 1
            prev = set(experts)
            accesses += len(experts)
            for n, cache in caches.items():
                hits[n] += sum(1 for e in experts if e in cache)
                for e in experts:
                    cache.pop(e, None)
                    cache[e] = None
                while len(cache) > n:
                    cache.pop(next(iter(cache)))
    top = max(1, math.ceil(0.1 * num_experts))
    total = sum(counts)
    return {
        "top10_share": sum(sorted(counts, reverse=True)[:top]) / total,
        "reuse": reuse_sum / max(1, reuse_n),
        "reuse_far": far_sum / max(1, far_n),
        **{f"lru_{n}": hits[n] / accesses for n in SLOTS},
    }


def uniform_reference(num_experts: int, k: int) -> dict:
    top = max(1, math.ceil(0.1 * num_experts))
    return {"top10_share": top / num_experts, "reuse": k / num_experts, "reuse_far": k / num_experts,
            **{f"lru_{n}": min(1.0, n / num_experts) for n in SLOTS}}


def mean_over_layers(per_layer: list[dict]) -> dict:
    return {key: sum(d[key] for d in per_layer) / len(per_layer) for key in per_layer[0]}


def measure(model_dir: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    cfg = model.config
    E, k, V = cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size
    layers = [layer.mlp.gate for layer in model.model.layers]
    record: list[list[list[int]]] = [[] for _ in layers]

    def hook(idx):
        def fn(_module, _inp, out):
            record[idx].extend(out[2].reshape(-1, k).tolist())  # (logits, scores, indices)
        return fn

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(layers)]
    gen = torch.Generator().manual_seed(args.seed)
    prompt_seqs: list[list[list[list[int]]]] = [[] for _ in layers]
    gen_seqs: list[list[list[list[int]]]] = [[] for _ in layers]
    with torch.no_grad():
        for _ in range(args.sequences):
            ids = torch.randint(0, V, (1, args.seq_len), generator=gen)
            for r in record:
                r.clear()
            model(ids)
            for i, r in enumerate(record):
                prompt_seqs[i].append(list(r))
        torch.manual_seed(args.seed)
        for _ in range(args.gen_sequences):
            ids = torch.randint(0, V, (1, 8), generator=gen)
            for r in record:
                r.clear()
            model.generate(ids, max_new_tokens=args.gen_tokens, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
            for i, r in enumerate(record):
                gen_seqs[i].append(list(r))
    for h in handles:
        h.remove()
    return {
        "prompts": mean_over_layers([routing_stats(s, E, k) for s in prompt_seqs]),
        "generation": mean_over_layers([routing_stats(s, E, k) for s in gen_seqs]),
        "per_layer_reuse": [routing_stats(s, E, k)["reuse"] for s in prompt_seqs],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo")
    p.add_argument("--layers", type=int, default=4, help="override num_hidden_layers (speed)")
    p.add_argument("--skews", default="0,0.5,1,2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--gen-sequences", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where to synthesize (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    from engine.api import load_preset, synthesize

    torch.set_num_threads(max(1, torch.get_num_threads()))
    geometry = load_preset(args.preset)
    if args.layers:
        geometry["num_hidden_layers"] = args.layers
    E, k = geometry["num_experts"], geometry["num_experts_per_tok"]
    skews = [float(s) for s in args.skews.split(",")]
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for skew in skews:
            t0 = time.perf_counter()
            d = synthesize(geometry, Path(tmp) / f"skew-{skew}", seed=args.seed, routing_skew=skew,
                           progress=False)
            res = measure(d, args)
            res["skew"] = skew
            res["seconds"] = time.perf_counter() - t0
            results.append(res)
            print(f"skew {skew}: done in {res['seconds']:.0f} s", file=sys.stderr)
    ref = uniform_reference(E, k)
    if args.json:
        from benchmarks.benchkit import emit, run_conditions
        emit("routing_skew", results, run_conditions(args), True, [], notes={"geometry": geometry, "uniform": ref})
        return 0

    print(f"# {args.preset} geometry, {geometry['num_hidden_layers']} layers, {E} experts top-{k}, seed {args.seed}; "
          f"prompts: {args.sequences} x {args.seq_len} random ids; generation: {args.gen_sequences} x "
          f"{args.gen_tokens} sampled tokens (T=1); transformers fp32 on CPU; means over layers")
    head = "| workload | skew | top10% | reuse | reuse@32 | LRU@8 | LRU@16 | LRU@24 | LRU@32 |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))

    def row(label, skew, m):
        cells = [f"{100 * m[key]:.1f}%" for key in ("top10_share", "reuse", "reuse_far")] + [
            f"{100 * m[f'lru_{n}']:.1f}%" for n in SLOTS]
        print(f"| {label} | {skew} | " + " | ".join(cells) + " |")

    row("uniform random", "-", ref)
    for r in results:
        row("random-id prompts", r["skew"], r["prompts"])
    for r in results:
        row("sampled generation", r["skew"], r["generation"])
    print("| real OLMoE (ANCHORS) | - | - | - | - | 27.7% | 53.7% | 68.4% | 79.4% |")
    print("| real GLM-5 (ANCHORS) | - | - | ~41% | - | - | - | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
