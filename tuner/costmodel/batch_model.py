"""Several sequences in one decode step (engine/arch/decode_rows.py): the expected union of their
experts, and the predicted step of B of them (`colibri plan --batch`, the serve objective's goodput
model, tuner/costmodel/serve_model.py).

A step of B rows reads the union of the B tokens' routed experts once (the one-token miss rate scaled
by union / top_k on the disk), the dense weights once, runs B rows of matmuls, and pays the per-layer
dispatch per row; the terms are predict.py's, from the same Components and Factors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from engine.api import BudgetError, EngineConfig

from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.model_geometry import ModelGeometry
from tuner.costmodel.predict import Factors, RunConditions, components, flop_seconds, weight_bytes_touched
from tuner.costmodel.routing_model import RoutingModel


def expected_union(routing: RoutingModel, top_k: int, batch: int) -> float:
    """Expected distinct experts per MoE layer that `batch` tokens of different sequences route to,
    averaged over layers: sum over experts of 1 - (1 - q)^B, q = the chance one token picks that
    expert (top_k · popularity, at most 1: top-k draws without replacement). Independent sequences
    share no locality, so popularity alone decides the overlap; uniform routing gives the most union."""
    q = np.minimum(1.0, top_k * routing.popularity)  # [layers, experts]
    return float((1.0 - (1.0 - q) ** batch).sum(axis=1).mean())


@dataclass
class BatchPoint:
    """One batch size's predicted step: every running sequence decodes one token."""

    batch: int
    fits: bool
    reason: str = ""
    union_experts: float | None = None  # per MoE layer and step
    bytes_per_step: float | None = None  # read from disk
    step_s: float | None = None
    per_sequence_tok_s: float | None = None
    aggregate_tok_s: float | None = None
    bottleneck: str | None = None
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def predict_batch(geometry: ModelGeometry, quant: str, config: EngineConfig, hw: HardwareView, routing: RoutingModel,
                  factors: Factors | None = None, run: RunConditions | None = None, overhead_bytes: int = 0,
                  batches=(1, 2, 4, 8), seed: int = 0) -> list[BatchPoint]:
    """Each batch size B's step (max_batch B: the plan charges B KV caches, so a B that cannot fit is
    named): the disk reads the union's misses (the one-token miss rate scaled by union / top_k),
    memory reads the dense weights once and the union of experts once, the matmuls run B rows, and the
    per-layer dispatch is per row (the batched step computes each row's attention and routing on its
    own). Aggregate tok/s = B / step; per sequence 1 / step. Where the bound moves shows in
    `bottleneck`: the disk's share falls with B while compute grows."""
    factors = factors or Factors()
    run = run or RunConditions.steady()
    points = []
    for B in batches:
        cfg = config.replace(max_batch=B)
        try:
            plan, rates, comps, _request, _qd = components(geometry, quant, cfg, hw, routing, run, overhead_bytes,
                                                           factors.lookahead_recall, seed)
        except BudgetError as exc:
            points.append(BatchPoint(B, False, reason=str(exc)))
            continue
        k = geometry.top_k
        union = expected_union(routing, k, B) if geometry.routed_experts else 0.0
        scale = union / k if k else 0.0  # the step's expert fetches against one token's
        threads = cfg.threads or hw.physical_cores
        expert = geometry.expert_bytes(quant)
        dense = weight_bytes_touched(geometry, quant) - geometry.moe_layers * k * expert
        t_mem = (dense + geometry.moe_layers * union * expert) / hw.memory_bandwidth(threads)
        t_flop = flop_seconds(geometry, quant, hw, B, threads)
        compute = max(t_mem, t_flop) / factors.eta_compute
        page = factors.page_cost(comps.io_mode)
        disk = comps.disk_s * scale / factors.eta_io + comps.page_bytes * scale * page
        requests = factors.c_request * comps.requests * scale
        fixed = factors.c_layer * comps.layers * B
        hidden = min(comps.covered * disk, factors.overlap * compute)
        step = fixed + compute + disk + requests - hidden
        terms = {"disk": disk - hidden, "memory" if t_mem >= t_flop else "compute": compute,
                 "overhead": fixed + requests}
        reads = (rates.decode_misses_per_token + rates.wasted_prefetch_per_token) if rates else 0.0
        points.append(BatchPoint(
            B, True, union_experts=round(union, 3), bytes_per_step=reads * scale * plan.expert_disk_bytes,
            step_s=step, per_sequence_tok_s=1.0 / step if step > 0 else None,
            aggregate_tok_s=B / step if step > 0 else None, bottleneck=max(terms, key=terms.get),
            seconds={"fixed": fixed, "compute": compute, "disk": disk, "requests": requests, "hidden": -hidden}))
    return points
