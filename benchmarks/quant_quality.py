"""Quantization quality on the trained reference: int8 and int4 g32/g64/g128 against bf16.

    python benchmarks/quant_quality.py --reference DIR --work DIR [--tokens 8192] [--ctx 512] [--json]

Converts the reference (benchmarks/train_reference.py) into each container under --work, then
`colibri quality` for each (teacher-forced on the held-out Python stdlib text, chunks of --ctx
with the second half of each scored, as llama-perplexity does), both models computed in fp32 so
the figures are the weights' error alone. Printed next to llama.cpp's published figures for
Llama-3-8B (docs: ../shared/notes/ANCHORS.md) — different model and size, same definitions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.format.convert import convert  # noqa: E402
from engine.run.quality import measure_quality  # noqa: E402

CASES = [("int8", "int8", 0), ("int4-g32", "int4", 32), ("int4-g64", "int4", 64), ("int4-g128", "int4", 128)]
# llama.cpp, Llama-3-8B vs FP16 (llama-perplexity --kl-divergence), as ANCHORS.md quotes them.
ANCHORS = {"int8": "Q8_0: KL 0.0014, same top-1 97.7%, ΔPPL +0.003",
           "int4-g32": "Q4_0 (g32): KL 0.072",
           "int4-g64": "Q4_K_M: KL 0.031, same top-1 91.9%, ΔPPL +0.18; torchao int4 g64 PPL 7.44 → 8.32",
           "int4-g128": "-"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True)
    ap.add_argument("--work", required=True, help="where the containers are written")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    rows = []
    for label, quant, group in CASES:
        dst = Path(a.work) / label
        convert(a.reference, dst, quant, group, force=True)
        r = measure_quality(dst, a.reference, tokens=a.tokens, ctx=a.ctx, dtype="fp32", threads=a.threads)
        r["label"] = label
        rows.append(r)
        print(f"{label}: KL {r['kl_mean']:.5f}", file=sys.stderr)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    r0 = rows[0]
    print(f"reference {a.reference}: perplexity {r0['ppl_reference']:.3f} (fp32 compute of the bf16 weights); "
          f"{r0['scored_tokens']} scored tokens ({r0['chunks']} chunks of {r0['ctx']}, second halves) of {r0['text']}")
    print("| container | mean KL | p99 KL | same top-1 | PPL | ΔPPL | PPL change | llama.cpp on Llama-3-8B |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['kl_mean']:.6f} | {r['kl_p99']:.6f} | {100 * r['top1_agreement']:.2f}% | "
              f"{r['ppl_model']:.3f} | {r['ppl_delta']:+.3f} | {100 * r['ppl_change']:+.2f}% | {ANCHORS[r['label']]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
