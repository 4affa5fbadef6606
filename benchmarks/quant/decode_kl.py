"""KL of a model's decode-path logits against a reference's: every position a one-token step.

    python benchmarks/quant/decode_kl.py --model Q [--model Q2 ...] --reference REF [--tokens 256] [--threads 2]

`colibri quality` scores each chunk in one forward pass (T > 1: prefill, where quantized weights go
through torch's packed kernels), so it never runs the native int8/int4 decode kernels, which take
one row (T == 1) and quantize the activations themselves (to int16, one scale per row). This walks the same held-out text (engine/run/quality.token_stream) one token
at a time through each model and the reference, resident, and reports KL(reference || model) of
the next-token distributions and the top-1 agreement. Environment switches of the native kernels
are read once per process: run once per setting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: engine, benchmarks

import torch  # noqa: E402

from engine.api import Engine, EngineConfig, token_stream  # noqa: E402
from benchmarks.benchkit import conditions, emit  # noqa: E402

COLUMNS = [("model", lambda r: r["model"]), ("KL mean", lambda r: f"{r['kl_mean']:.6f}"),
           ("KL p99", lambda r: f"{r['kl_p99']:.6f}"), ("KL max", lambda r: f"{r['kl_max']:.6f}"),
           ("top-1", lambda r: f"{100 * r['top1']:.2f}%")]


def decode_logprobs(model_dir: str, ids: list[int], threads: int) -> torch.Tensor:
    """[len(ids), V] log-probabilities, position p from the one-token step of ids[p] after ids[:p]."""
    with Engine(model_dir, EngineConfig(ctx_size=len(ids) + 1, threads=threads)) as engine:
        rows = []
        for pos, token in enumerate(ids):
            logits = engine.forward([token], pos)
            rows.append(torch.log_softmax(logits.reshape(-1, logits.shape[-1])[-1].float(), dim=-1))
    return torch.stack(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    ids, text = token_stream(a.reference, a.tokens, None)
    ref = decode_logprobs(a.reference, ids, a.threads)
    env = {k: v for k, v in os.environ.items() if k.startswith("COLIBRI_NATIVE")}
    rows = []
    for model in a.model:
        lq = decode_logprobs(model, ids, a.threads)
        kl = (ref.exp() * (ref - lq)).sum(-1).clamp_min(0.0).double()
        rows.append({"model": model, "tokens": len(ids), "kl_mean": float(kl.mean()),
                     "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
                     "top1": float((ref.argmax(-1) == lq.argmax(-1)).double().mean())})
    # The native kernels' switches are read once per process, so they are part of the conditions.
    cond = conditions(reference=a.reference, tokens=len(ids), text=text, threads=a.threads, env=env or None)
    emit("decode_kl", rows, cond, a.json, COLUMNS)


if __name__ == "__main__":
    main()
