"""Routing rules beyond softmax top-k, one object per rule, chosen by ModelArgs.router.

    SigmoidGroupRouter   deepseek_v3, glm4_moe, glm_moe_dsa: sigmoid scores; a per-expert
                         `e_score_correction_bias` shifts the scores used to *choose* experts
                         (never the weights they get); experts are split into `n_group` groups,
                         each group scored by the sum of its two best, only the `topk_group`
                         best groups compete; the chosen scores are renormalised and multiplied
                         by `routed_scaling_factor`.
    BiasedTopkSoftmax    gpt_oss: router with a bias; top-k of the logits, softmax over those k.

The same object serves the MoE layer and router lookahead, so lookahead predicts with exactly
the rule the layer will use. Shapes: x [T, H] → ids [T, K] (int64), weights [T, K].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine import native
from engine.base.errors import ConfigError


class _TwoTensorRouter:
    """A router stored as `<prefix>.weight` plus one bias tensor, named by the subclass."""

    prefix: str
    bias_name: ClassVar[str]

    def names(self, layer_prefix: str) -> list[str]:
        return [f"{layer_prefix}.{self.prefix}.weight", f"{layer_prefix}.{self.prefix}.{self.bias_name}"]

    def tensors(self, w: dict, layer_prefix: str):
        return (w[n] for n in self.names(layer_prefix))


@dataclass(frozen=True)
class SigmoidGroupRouter(_TwoTensorRouter):
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    prefix: str = "mlp.gate"
    bias_name: ClassVar[str] = "e_score_correction_bias"  # shifts the choice only

    def route(self, w: dict, layer_prefix: str, x: torch.Tensor):
        weight, bias = self.tensors(w, layer_prefix)
        if native_rows(x, weight):  # decode, a verify, a batched step: one call, each row by itself
            return native.route_sigmoid_group(x, weight, bias, self.top_k, self.n_group, self.topk_group,
                                              bool(self.norm_topk_prob), float(self.routed_scaling_factor))
        # Router math in fp32 whatever the compute dtype, as the reference does: with 256
        # experts, bf16 logits would tie and reorder the selection.
        scores = fp32_logits(x, weight).sigmoid()  # [T, E]
        choice = scores + bias.float()
        T, E, G = x.shape[0], self.num_experts, self.n_group
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, K]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.routed_scaling_factor).to(x.dtype)


# Up to this many tokens the fp32 logits come from the native kernel (decode, a verify, a batched
# step); a prompt's group takes torch's fp32 matmul, whose one weight conversion is shared by its tokens.
NATIVE_ROUTER_ROWS = 64


def native_rows(x: torch.Tensor, weight) -> bool:
    """Whether x's rows (bf16, at most NATIVE_ROUTER_ROWS) route through a native router kernel."""
    return (native.ready and x.shape[0] <= NATIVE_ROUTER_ROWS and x.dtype is torch.bfloat16
            and type(weight) is torch.Tensor and weight.dtype is torch.bfloat16 and x.device.type == "cpu"
            and weight.device.type == "cpu")


def fp32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ weight.T in fp32 → [T, E]. A few bf16 rows on the CPU: the native kernel, which widens
    the bf16 weight in registers (F.linear needs it converted to an fp32 copy first, every call) and
    gives each row the same bits whatever the rows beside it."""
    if (native.ready and x.shape[0] <= NATIVE_ROUTER_ROWS and type(weight) is torch.Tensor
            and weight.dtype is torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"):
        return native.linear_f32(x.float(), weight)
    return F.linear(x.float(), weight.float())


@dataclass(frozen=True)
class BiasedTopkSoftmax(_TwoTensorRouter):
    top_k: int
    prefix: str = "mlp.router"
    bias_name: ClassVar[str] = "bias"

    def route(self, w: dict, layer_prefix: str, x: torch.Tensor):
        weight, bias = self.tensors(w, layer_prefix)
        logits = F.linear(x, weight, bias)  # [T, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1, dtype=top.dtype)


# --- lossy trims (EngineConfig.top_k_reduction / expert_threshold; off by default) -------------

@dataclass(frozen=True)
class RoutingTrim:
    """Fewer experts per token than the architecture routes, at a cost in quality.

    reduction: use the K - reduction heaviest of the rule's K experts. threshold: skip an
    expert whose share of the K experts' total weight is below it (the heaviest always stays,
    so every token keeps one). renormalize: whether the architecture normalises its top-k
    weights (norm_topk_prob, softmax over the chosen logits); then the kept weights are scaled
    back to the K experts' total (1, or routed_scaling_factor), as that rule would have given
    had it chosen fewer; otherwise they keep their raw probabilities.
    """

    reduction: int
    threshold: float
    renormalize: bool

    def apply(self, ids: torch.Tensor, weights: torch.Tensor):
        """ids, weights [T, K] → [T, K - reduction]. A skipped slot is id -1 with weight 0, except
        for one token (decode), whose skipped slots are dropped: ids [1, kept].

        Every step has one defined result, so the fused native layers (engine/native/moe_kernels.h
        trim_experts) reproduce it bit for bit: a stable sort (equal weights keep the rule's order;
        torch.topk leaves ties unordered) and fp32 totals summed left to right (torch.sum's order
        is its own)."""
        T, K = ids.shape
        w = weights.float()
        total = _sum_left_to_right(w)  # [T, 1]
        kept_w, order = torch.sort(w, dim=-1, descending=True, stable=True)  # heaviest first
        kept_w, order = kept_w[:, :K - self.reduction], order[:, :K - self.reduction]
        kept_ids = ids.gather(1, order)
        skip = None
        if self.threshold > 0:
            skip = kept_w < self.threshold * total
            skip[:, 0] = False
            kept_w = kept_w.masked_fill(skip, 0.0)
        if self.renormalize:
            kept_w = kept_w * (total / _sum_left_to_right(kept_w).clamp_min(1e-20))
        if skip is not None and skip.any():
            if T == 1:
                keep = ~skip[0]
                return kept_ids[:, keep], kept_w[:, keep].to(weights.dtype)
            kept_ids = kept_ids.masked_fill(skip, -1)
        return kept_ids, kept_w.to(weights.dtype)


def _sum_left_to_right(w: torch.Tensor) -> torch.Tensor:
    """[T, n] fp32 → [T, 1]: the row sums, column after column (a handful: n is top_k)."""
    total = w[:, :1].clone()
    for j in range(1, w.shape[1]):
        total += w[:, j:j + 1]
    return total


def trim_operands(trim: RoutingTrim | None) -> tuple[int, float, bool]:
    """(reduction, threshold, renormalize) for the fused native layers, which apply the trim inside
    (engine/native/moe_kernels.h trim_experts, the same bits as apply); (0, 0.0, False): no trim."""
    return (0, 0.0, False) if trim is None else (int(trim.reduction), float(trim.threshold), bool(trim.renormalize))


def routing_trim(args, reduction: int, threshold: float) -> RoutingTrim | None:
    """The trim an EngineConfig asks for on this model; None when off (routing untouched)."""
    if not reduction and not threshold:
        return None
    if not args.is_moe:
        raise ConfigError(f"top_k_reduction / expert_threshold apply to routed experts; {args.model_type} "
                          f"is a dense model")
    if reduction >= args.top_k:
        raise ConfigError(f"top_k_reduction {reduction} leaves no expert: the model routes {args.top_k} per token")
    renormalize = args.norm_topk_prob if args.router is None else getattr(args.router, "norm_topk_prob", True)
    return RoutingTrim(reduction, float(threshold), bool(renormalize))
