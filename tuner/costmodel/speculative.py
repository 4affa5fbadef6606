"""What speculative decoding would do to decode speed: `colibri plan --accept-rate`, and `doctor`.

The engine's gate (engine/run/spec_gate.py) decides each step's depth from what it measures;
this predicts the same trade before anything runs, from the profile and the routing model. A
step drafting k tokens verifies n = k + 1 rows in one forward pass, whose terms (predict.combine)
scale from the plain token's:

    compute(n)   the larger of the memory-bound read (the dense weights once, the union of the
                 rows' experts) and the FLOPs of n rows: rows share their weight reads
    disk(n)      the plain token's expert reads times union(n): the union's misses, at the
                 plain token's hit rate; its requests and page-cache cost alike
    hidden(n)    the lookahead's covered share of that disk time, as for one row
    fixed(n)     the per-layer dispatch, per row (batch_model.predict_batch counts a batch's rows so)

union(n) is the routing model's expected number of distinct experts n consecutive tokens pick in
a layer, in units of one token's top_k (per layer and expert e: a token picks e with probability
pi_e = top_k * popularity_e; a following token keeps each previous expert with the model's
locality l and otherwise draws afresh, so e is missed by all n with probability
(1 - pi_e) (1 - (1 - l) pi_e)^(n - 1)). The tokens a step produces on average are
E(k) = 1 + a + ... + a^k at acceptance a; the speed-up of depth k is E(k) * t(1) / (t(n) + k * d),
d the drafter's cost per token (prompt lookup: none; the MTP layer: one decoder layer of the model).
The gate's answer is the best depth, or none (off) when no depth beats a plain token by the engine
gate's margin (DRAFT_GAIN).
"""

from __future__ import annotations

import numpy as np

from engine.api import DRAFT_GAIN, EngineConfig, expected_tokens

from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.model_geometry import ModelGeometry
from tuner.costmodel.predict import (Factors, RunConditions, combine, components, flop_seconds,
                                     weight_bytes_touched)
from tuner.costmodel.routing_model import RoutingModel

# Published acceptance of GLM's MTP drafting (Colibrì measured 2.2-2.8 tokens per forward at
# depth 3, about a = 0.6-0.8): what doctor assumes when asked nothing else.
DEFAULT_ACCEPTANCE = 0.7


def verify_union(routing: RoutingModel, top_k: int, rows: int) -> float:
    """Distinct experts `rows` consecutive tokens pick per layer, in units of one token's top_k
    (the module doc's formula, averaged over the layers)."""
    if rows <= 1 or top_k <= 0:
        return 1.0
    pi = np.minimum(1.0, top_k * routing.popularity)  # [layers, experts]
    missed = (1.0 - pi) * (1.0 - (1.0 - routing.locality) * pi) ** (rows - 1)
    return float((1.0 - missed).sum(axis=1).mean() / top_k)


def draft_prediction(geometry: ModelGeometry, quant: str, config: EngineConfig, hw: HardwareView,
                     routing: RoutingModel, factors: Factors, run: RunConditions, overhead_bytes: int,
                     acceptance: float, drafter: str = "lookup") -> dict:
    """Per depth 1..config.draft_depth: tokens per step, the verify's union, bytes per token and the
    predicted speed-up over plain decoding; and the gate's choice. Raises BudgetError if the config
    cannot fit (drafting's own memory included)."""
    config = config.replace(draft="gate")
    plan, rates, comps, _request, _qd = components(geometry, quant, config, hw, routing, run, overhead_bytes,
                                                   factors.lookahead_recall)
    plain = combine(comps, factors)
    token_s = plain["token_s"]
    threads = config.threads or hw.physical_cores
    k_exp, layers = geometry.top_k, geometry.moe_layers
    expert_bytes = geometry.expert_bytes(quant)
    dense = weight_bytes_touched(geometry, quant) - layers * k_exp * expert_bytes
    reads = (rates.decode_misses_per_token + rates.wasted_prefetch_per_token) if rates else 0.0
    plain_bytes = reads * plan.expert_disk_bytes

    def compute(rows: int, union: float) -> float:
        t_mem = (dense + layers * k_exp * union * expert_bytes) / hw.memory_bandwidth(threads)
        return max(t_mem, flop_seconds(geometry, quant, hw, rows, threads))

    one = compute(1, 1.0)
    # Drafting one token with the MTP layer: one decoder layer of the model, its share of a token.
    draft_s = token_s / max(geometry.num_layers, 1) if drafter == "mtp" else 0.0
    depths = []
    for k in range(1, config.draft_depth + 1):
        rows = k + 1
        union = verify_union(routing, k_exp, rows) if geometry.routed_experts else 1.0
        t = plain["terms"]
        comp = t["compute"] * compute(rows, union) / one if one else t["compute"]
        disk = t["disk"] * union
        hidden = min(comps.covered * disk, factors.overlap * comp)
        # fixed: per row, as predict_batch counts it (each row's attention and routing on its own)
        step = t["fixed"] * rows + comp + disk + t["requests"] * union - hidden + k * draft_s
        produced = expected_tokens(k, acceptance)
        depths.append({"depth": k, "tokens_per_step": round(produced, 4), "union": round(union, 4),
                       "bytes_per_token": plain_bytes * union / produced,
                       "speedup": round(produced * token_s / step, 4) if step > 0 else None})
    best = max(depths, key=lambda d: d["speedup"] or 0.0, default=None)
    drafts = best is not None and (best["speedup"] or 0.0) > DRAFT_GAIN  # the engine's gate's margin
    return {"acceptance": acceptance, "drafter": drafter, "plain_tok_s": 1.0 / token_s if token_s > 0 else None,
            "plain_bytes_per_token": plain_bytes, "depths": depths,
            "best_depth": best["depth"] if drafts else 0, "best_speedup": best["speedup"] if best else None,
            "gate": (f"drafts {best['depth']} tokens per step: {best['speedup']:.2f}x" if drafts else
                     f"off: no depth is {DRAFT_GAIN:.2f}x plain decoding or more (best {best['speedup']:.2f}x at depth "
                     f"{best['depth']})" if best else "off")}
