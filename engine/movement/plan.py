"""The memory plan: what goes where under the budget, decided before anything is loaded.

    budget = dense (resident, compute dtype) + KV (ctx_size, kv_dtype; one per sequence of max_batch)
             + read buffers
             + runtime overhead + prefill activations + prefix cache + drafting + RAM expert cache

The prefix cache (EngineConfig.prefix_cache, engine/run/prefix_cache.py) is charged whole: its
blocks fill it over the server's life, so its size is what it will hold. Speculative decoding
(EngineConfig.draft, engine/run/speculative.py) is charged its verify rows, its lookup mirror and
the MTP layer it drafts with (draft_bytes).

The runtime overhead is measured, not guessed: the process's resident set at planning time
(interpreter, torch, the checkpoint index) plus a margin for a decode step's activations and
logits. A prompt is prefilled in groups of at most `prefill_group` tokens, each group taken through one
layer at a time (engine/arch/prefill.py: each routed expert read once per layer per group), its
attention and dense parts in sub-chunks of PREFILL_CHUNK tokens. The plan charges what a group holds
for its whole prefill (prefill_group_bytes: the hidden state, the routing, the routed sum; a few KiB
a token) plus one sub-chunk's transients at the longest context (prefill_activation_bytes: counted
from the model's geometry, times the allocator's factor, and the native matmul caches' bound).
The group is EngineConfig.prefill_chunk where set (a budget that cannot hold it is refused), else
the largest the budget allows: the whole context, shrunk to half of what the budget leaves after
everything else (the other half stays for the expert cache), in whole sub-chunks, or below one
sub-chunk a power of two whose transients shrink with it; a budget that cannot hold a one-token
group is refused. If the parts cannot fit, one error lists them, so the user sees which part to shrink.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import psutil
import torch

from engine.format.checkpoint import Checkpoint
from engine.base.config import PREFILL_CHUNK, EngineConfig, format_size
from engine.base.errors import BudgetError, DraftBudgetError
from engine.base.heap import NATIVE_CACHE_BYTES
from engine.format.container import dense_nbytes, dense_quantized
from engine.format.layout import cast_bytes, expert_memory_bytes
from engine.arch import kv_snapshot
from engine.arch.args import ModelArgs, dense_tensor_names
from engine.format import fp8_checkpoint

ACTIVATION_MARGIN = 64 << 20  # hidden states, logits, attention scores of a decode step
ALIGN_SLACK = 2 * 4096  # an O_DIRECT window can start up to 4 KiB early and end 4 KiB late
# The counted live bytes of a sub-chunk (prefill_transient_bytes, which tests/test_prefill_charge.py
# holds above the tensors really allocated) understate its resident high-water mark: transients are
# freed and re-allocated per layer and per expert, and glibc keeps freed blocks between. Measured on
# demo-small (hidden 512, 2,000-token prompt, 256-token passes): ~31 MiB above the steady state for
# ~6.6 MiB counted, so 5x. (That figure held part of ideep's matmul cache, uncapped then; capped
# (engine/base/heap.py, charged apart as NATIVE_CACHE_BYTES), demo under 1 GiB, 2,048-token group:
# +117 MiB resident at the peak, the KV cache's first touch included, for 196 MiB charged.)
PREFILL_ALLOCATOR_FACTOR = 5


def _elem(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass
class MemoryPlan:
    budget: int
    streaming: bool
    dense_bytes: int
    kv_bytes: int
    buffer_bytes: int
    overhead_bytes: int
    cache_bytes: int  # RAM expert tier
    gpu_cache_bytes: int
    expert_bytes: int  # one routed expert in the compute dtype
    expert_disk_bytes: int
    routed_experts: int
    max_inflight_experts: int
    # Layer streaming (dense models): the first `resident_layers` stay in RAM, the rest are
    # read per token, `prefetch_depth` layers ahead.
    resident_layers: int = 0
    layer_bytes: int = 0
    # Expert streaming: every read lands in a slot of `slot_bytes`; the arena has `arena_slots`
    # (the reads in flight, plus one per cache entry when the cache holds the slots themselves,
    # i.e. when compute tensors are zero-copy views of the read bytes). A cache entry is
    # charged `cache_entry_bytes`: a slot, or a converted expert.
    slot_bytes: int = 0
    arena_slots: int = 0
    cache_entry_bytes: int = 0
    # A prefill group's activations (prefill_group_bytes) and one sub-chunk's transients
    # (prefill_activation_bytes), beside the decode margin the runtime overhead already holds.
    prefill_bytes: int = 0
    prefill_group: int = 0  # prompt tokens per layer-major group, the one prefill_bytes charges
    prefill_norm_held: bool = False  # the group holds the MoE's normed input (prefill_norm_held)
    # The RAM prefix cache (EngineConfig.prefix_cache): the KV blocks of recent sequences.
    prefix_cache_bytes: int = 0
    # Speculative decoding (EngineConfig.draft): the drafter's index, weights and cache, and what a
    # verify's rows need beyond the prompt group's charge (draft_bytes: a verify never runs beside a group).
    draft_bytes: int = 0

    @property
    def cache_slots(self) -> int:
        entry = self.cache_entry_bytes or self.expert_bytes
        return self.cache_bytes // entry if entry else 0

    @property
    def fixed_bytes(self) -> int:
        """Everything the budget holds besides the expert caches (make_plan's `fixed`)."""
        return (self.dense_bytes + self.kv_bytes + self.buffer_bytes + self.overhead_bytes + self.prefill_bytes
                + self.prefix_cache_bytes + self.draft_bytes)

    def unspent_cache_bytes(self, cpu_cache_ratio: float) -> int:
        """What the RAM cache's share of the budget leaves after its whole entries (less than one entry,
        or more where every routed expert fits): a drafter's idle bytes lent to the cache join it, so a
        lent cache holds the entries a plan without the drafter would (engine/movement/cache_loan.py)."""
        if not self.streaming or self.budget <= 0:
            return 0
        return max(0, int((self.budget - self.fixed_bytes) * cpu_cache_ratio) - self.cache_bytes)

    @property
    def projected_hit_rate(self) -> float:
        """Share of expert bytes the caches can hold: the hit rate of uniform routing."""
        if not self.routed_experts:
            return 1.0
        held = self.cache_slots + self.gpu_cache_bytes // max(self.expert_bytes, 1)
        return min(1.0, held / self.routed_experts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cache_slots"] = self.cache_slots
        d["projected_hit_rate"] = round(self.projected_hit_rate, 4)
        return d

    def describe(self) -> str:
        return (f"dense {format_size(self.dense_bytes)} + KV {format_size(self.kv_bytes)} + read buffers "
                f"{format_size(self.buffer_bytes)} + runtime {format_size(self.overhead_bytes)} + prefill "
                f"({self.prefill_group}-token groups) {format_size(self.prefill_bytes)} + prefix cache "
                f"{format_size(self.prefix_cache_bytes)} + drafting {format_size(self.draft_bytes)} + expert cache "
                f"{format_size(self.cache_bytes)} of budget {format_size(self.budget)}")


def prefill_tokens_per_pass(ctx_size: int, chunk: int = PREFILL_CHUNK) -> int:
    """The most prompt tokens one sub-chunk (or group) of `chunk` holds: chunk, or the whole
    context if shorter."""
    return max(1, min(ctx_size, chunk))


def prefill_group_bytes(args: ModelArgs, tokens: int, dtype: torch.dtype, ctx_size: int,
                        norm_held: bool = False) -> int:
    """What a layer-major group of `tokens` prompt tokens holds for its whole prefill
    (engine/arch/prefill.py), allocated once per group, so without the allocator factor.

    Per token (e = compute dtype bytes; H hidden, K top-k, D head_dim): the residual (H); for a
    MoE model the routed sum (H in its accumulation dtype: fp32 for bf16, each expert's rows added
    as the expert is applied, so no routed slot's output is held), the routing ids and weights and
    their sort (K int64 ids, order, tokens and sorted ids; K weights twice); the sub-chunks' rope
    rows (2 of D); for the DSA indexer, each sub-chunk's selection, one byte per position of the
    context. norm_held: also the MoE's normed input (H), held for the group where the budget has
    room (prefill_norm_held); else each use norms its rows again, K times a token for the routed
    experts."""
    e = _elem(dtype)
    per_token = args.hidden_size * e + 2 * args.head_dim * e
    if norm_held and args.num_experts:
        per_token += args.hidden_size * e
    if args.num_experts:
        per_token += args.hidden_size * max(e, 4) + args.top_k * (4 * 8 + 2 * e)
    if getattr(args.attention_impl, "indexer", None) is not None:
        per_token += ctx_size
    return int(tokens * per_token)


def prefill_bytes(args: ModelArgs, group: int, dtype: torch.dtype, ctx_size: int,
                  kv_dtype: torch.dtype | None = None, norm_held: bool = False) -> int:
    """The plan's prefill charge for groups of `group` tokens: the group's state and one sub-chunk's
    transients."""
    sub = prefill_tokens_per_pass(min(ctx_size, group))
    return (prefill_group_bytes(args, group, dtype, ctx_size, norm_held)
            + prefill_activation_bytes(args, sub, dtype, ctx_size, kv_dtype))


def prefill_group_for(args: ModelArgs, config: EngineConfig, dtype: torch.dtype, left: int | None,
                      kv_dtype: torch.dtype | None = None) -> int:
    """Prompt tokens per group: prefill_chunk where set; else the whole context, or under a budget
    the most whose group state fits half of `left` (what the budget leaves after everything but the
    group state and the cache, one sub-chunk's transients charged), a whole number of sub-chunks;
    below one sub-chunk, the largest power of two whose whole charge fits."""
    if config.prefill_chunk:
        return prefill_tokens_per_pass(config.ctx_size, config.prefill_chunk)
    group = config.ctx_size
    if left is None:
        return group
    # Half, not all: the other half stays for the expert cache, which a prompt's decode needs too.
    # (Between f394868 and the charge's measurement (tests/test_prefill_charge.py, engine/base/heap.py)
    # the default was one sub-chunk: ideep's uncapped matmul cache had OOM-killed larger groups.)
    per_token = max(1, prefill_group_bytes(args, 1, dtype, config.ctx_size))
    fits = max(0, left) // 2 // per_token
    if fits >= group:
        return group
    sub = prefill_tokens_per_pass(config.ctx_size)
    if fits >= sub:
        return fits // sub * sub
    # Not even one sub-chunk's state: a smaller group, whose sub-chunk shrinks with it (the
    # transients `left` was counted without are then a smaller group's too).
    room = prefill_activation_bytes(args, sub, dtype, config.ctx_size, kv_dtype) + (left // 2 if left > 0 else left)
    while sub > 1 and prefill_bytes(args, sub, dtype, config.ctx_size, kv_dtype) > room:
        sub //= 2
    return sub


def prefill_norm_held(args: ModelArgs, group: int, dtype: torch.dtype, ctx_size: int, left: int | None) -> bool:
    """Whether a group of `group` tokens holds the MoE's normed input: without a budget, or where the
    group's state with it still fits half of `left` (prefill_group_for's rule). Holding it is one
    gather per routed slot; not holding it norms each token again for every slot (K times), which
    on demo's 2,048-token prompt costs more than a second; a group that would have to shrink to
    hold it (more groups, each reading its experts again) does not."""
    if left is None:
        return True
    return group * prefill_group_bytes(args, 1, dtype, ctx_size, True) <= max(0, left) // 2


def prefill_transient_bytes(args: ModelArgs, tokens: int, dtype: torch.dtype, ctx_size: int | None = None,
                            kv_dtype: torch.dtype | None = None) -> int:
    """Live bytes of one sub-chunk's transients at their peak, counted from the geometry (no allocator
    factor): what tests/test_prefill_charge.py checks against the tensors a prefill really allocates."""
    per_token, per_chunk = _transient_parts(args, tokens, dtype, ctx_size, kv_dtype)
    return tokens * per_token + per_chunk


def prefill_activation_bytes(args: ModelArgs, tokens: int, dtype: torch.dtype, ctx_size: int | None = None,
                             kv_dtype: torch.dtype | None = None) -> int:
    """The plan's charge for one sub-chunk of `tokens` prompt tokens (one layer's forward at a time):
    its per-token transients times the allocator's high-water factor (they are freed and re-allocated
    per layer and per expert), its per-chunk ones (a few large blocks), the fp32 logits of the last
    position, and what the native matmul caches hold (engine/base/heap.py)."""
    per_token, per_chunk = _transient_parts(args, tokens, dtype, ctx_size, kv_dtype)
    return int(PREFILL_ALLOCATOR_FACTOR * tokens * per_token + per_chunk + 4 * args.vocab_size + NATIVE_CACHE_BYTES)


def _transient_parts(args: ModelArgs, tokens: int, dtype: torch.dtype, ctx_size: int | None,
                     kv_dtype: torch.dtype | None) -> tuple[int, int]:
    """(bytes per token, bytes per sub-chunk) of one sub-chunk's transients at their peak.

    Per token (e = compute dtype bytes; H hidden, Nq/Nkv heads of D, K top-k, I expert intermediate,
    E experts, S = ctx_size positions): the residual stream and its norms (3 tensors of H, plus the
    fp32 norm), q/k/v and the attention output, the causal mask [T, S] (bool, its window term, the
    fp32 additive form SDPA makes of it) and SDPA's score block, and
    the largest of the MLP parts: a dense MLP's or the shared experts' gate (or its SiLU), up and
    product (3 of their intermediate), or a MoE layer's call of sub*K rows: the gathered input rows,
    the expert's and the weighted outputs (3K of H), the fused gate_up, its SiLU and the product (4 I
    each of K slots), the router's fp32 probabilities (2 of E). Per sub-chunk: the keys and values
    attended, read back in the compute dtype where the KV cache stores `kv_dtype` (a quantized
    cache; the same dtype is read in place), and what an attention
    that writes its scores out materializes (its `prefill_scores_bytes`: MLA, gpt-oss), bounded by
    query blocks (engine/arch/layers.py query_rows)."""
    e = _elem(dtype)
    S = max(int(ctx_size or tokens), tokens)
    residual = (3 * e + 4) * args.hidden_size
    # q/k/v and the output; the causal mask [T, S] (bool, its window term, and the fp32 additive
    # form SDPA makes of it); SDPA's flash kernel's score block (its key split: 512 positions at most).
    attention = e * (2 * args.num_heads + 2 * args.num_kv_heads) * args.head_dim + 6 * S + 4 * min(S, 512)
    mlp = 3 * e * max(args.intermediate_size, args.shared_experts_intermediate_size or 0,
                      args.shared_expert_intermediate_size or 0)
    moe = (3 * args.top_k * args.hidden_size * e + 4 * args.top_k * args.moe_intermediate_size * e
           + 2 * 4 * args.num_experts) if args.num_experts else 0
    per_token = residual + attention + max(mlp, moe)
    # Read back in the compute dtype: a copy only where the cache stores another (int8, fp8).
    attended = 2 * args.num_kv_heads * S * args.head_dim * e if kv_dtype is not None and kv_dtype != dtype else 0
    impl = args.attention_impl
    scores = impl.prefill_scores_bytes(tokens, S) if hasattr(impl, "prefill_scores_bytes") else 0
    return int(per_token), int(attended + scores)


# What prompt lookup keeps per context token (engine/run/drafters.py PromptLookup): its int32 mirror of
# the sequence with room to double (8), and a scan's temporaries at most (a bool per token, int64
# candidate positions); measured at its peak: 20 bytes a token.
LOOKUP_BYTES_PER_TOKEN = 24


def draft_bytes(args: ModelArgs, config: EngineConfig, dtype: torch.dtype, mtp_bytes: int = 0) -> tuple[int, int]:
    """What speculative decoding adds (EngineConfig.draft on), as (held, verify): held for the engine's
    life, the prompt lookup's mirror of the context (not drafter mtp's: it keeps none) and the drafter's own
    weights and cache (`mtp_bytes`: the checkpoint's MTP layer); verify, live only while a verify runs, its draft_depth + 1 rows'
    transients (as a prefill sub-chunk of that many tokens) and per row the fp32 logits, their shaped
    copy and the sampler's probabilities. A verify never runs beside a prompt's group, so the plan
    charges only what it needs beyond the group's charge (_fixed_bytes)."""
    if config.draft == "off":
        return 0, 0
    lookup = LOOKUP_BYTES_PER_TOKEN * config.ctx_size if config.drafter != "mtp" else 0
    rows = config.draft_depth + 1
    # The native matmul caches are charged once, with the prefill (prefill_activation_bytes).
    verify = (prefill_activation_bytes(args, rows, dtype, config.ctx_size) - NATIVE_CACHE_BYTES
              + 3 * rows * 4 * args.vocab_size)
    return lookup + mtp_bytes, verify


def make_plan(ckpt: Checkpoint, args: ModelArgs, layout, config: EngineConfig, dtype: torch.dtype,
              kv_dtype: torch.dtype, overhead_bytes: int | None = None, keep_positions: bool | None = None,
              mtp_bytes: int = 0) -> MemoryPlan:
    """keep_positions: the KV cache holds every position of every layer (reuse needs it, see
    engine/arch/kv_snapshot.py); None: when the prefix cache is on. mtp_bytes: the resident MTP
    layer and its cache when it drafts (its experts are in the layout, streamed like any layer's)."""
    dense = _dense_bytes(ckpt, args, getattr(layout, "quant", None), dtype)
    keep = config.prefix_cache > 0 if keep_positions is None else keep_positions
    # The engine's own cache, and one per further sequence a batch may run (EngineConfig.max_batch).
    kv = (kv_snapshot.nbytes(args, config.ctx_size, kv_dtype, keep)
          + (config.max_batch - 1) * kv_snapshot.nbytes(args, config.ctx_size, kv_dtype, False))
    prefix = config.prefix_cache
    drafting = draft_bytes(args, config, dtype, mtp_bytes)
    # Any prompt up to ctx_size may come: charge the largest sub-chunk one can fill (the group: below).
    transients = prefill_activation_bytes(args, prefill_tokens_per_pass(config.ctx_size), dtype, config.ctx_size, kv_dtype)
    routed = layout.num_routed if layout is not None else 0
    disk_expert = layout.expert_nbytes if layout is not None else 0
    expert = expert_memory_bytes(layout, dtype) if routed else 0
    if overhead_bytes is None:
        overhead_bytes = psutil.Process().memory_info().rss + ACTIVATION_MARGIN
    # Reads in flight, demand and lookahead together: the current layer's misses plus
    # `prefetch_depth` layers of lookahead. The store never holds more.
    inflight = args.top_k * (1 + config.prefetch_depth) if routed else 0
    mapped = config.io_mode == "mmap"
    views = layout is not None and routed and layout.zero_copy(dtype)
    slot = 0 if mapped or not routed else layout.slot_bytes(direct=config.io_mode == "direct")
    # mmap reads are page-cache pages (the expert's disk bytes); others land in a slot. A cast
    # expert (bf16 on disk, fp32 compute) also exists converted while its read is held.
    # A quantized expert's codes are views of its slot; scales cast to the compute dtype are not.
    cast = cast_bytes(layout, dtype) if views else 0
    buffers = inflight * ((disk_expert if mapped else slot) + (cast if views else expert))
    entry = slot + cast if views and not mapped else expert
    budget = config.ram_budget

    if budget > 0 and routed == 0:
        return _dense_plan(ckpt, args, config, dtype, kv, overhead_bytes, transients, prefix, drafting, kv_dtype)
    if budget <= 0 or routed == 0:
        group = prefill_group_for(args, config, dtype, None, kv_dtype)
        prefill = prefill_bytes(args, group, dtype, config.ctx_size, kv_dtype, True)
        return MemoryPlan(budget, False, dense, kv, 0, overhead_bytes, routed * expert, 0, expert, disk_expert,
                          routed, inflight, prefill_bytes=prefill, prefill_group=group, prefill_norm_held=True,
                          prefix_cache_bytes=prefix, draft_bytes=_draft_charge(drafting, prefill))
    group, held, prefill, fixed, charged = _fixed_bytes(args, config, dtype, kv_dtype, ("dense weights", dense), kv,
                                                 ("read buffers", buffers), overhead_bytes, transients, prefix,
                                                 drafting, after=" before any expert cache")
    # Whole entries only, so the cache's byte capacity is exactly its slots.
    cache = min(int((budget - fixed) * config.cpu_cache_ratio) // entry, routed) * entry
    gpu_cache = 0
    if config.gpu_cache_ratio > 0 and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info()
        gpu_cache = min(int(free * config.gpu_cache_ratio), routed * expert)
    arena = 0 if mapped else inflight + (cache // entry if views else 0)
    return MemoryPlan(budget, True, dense, kv, buffers, overhead_bytes, cache, gpu_cache, expert, disk_expert,
                      routed, inflight, slot_bytes=slot, arena_slots=arena, cache_entry_bytes=entry,
                      prefill_bytes=prefill, prefill_group=group, prefill_norm_held=held, prefix_cache_bytes=prefix,
                      draft_bytes=charged)


def _draft_charge(drafting: tuple[int, int], prefill: int) -> int:
    """What the plan charges for draft_bytes' (held, verify) beside a prompt group's charge `prefill`:
    a verify runs after the prompt, not beside it, so only what it needs beyond the group's bytes."""
    held, verify = drafting
    return held + max(0, verify - prefill)


def _fixed_bytes(args: ModelArgs, config: EngineConfig, dtype: torch.dtype, kv_dtype, weights: tuple[str, int],
                 kv: int, buffers: tuple[str, int], overhead: int, transients: int, prefix: int,
                 drafting: tuple[int, int], after: str = "") -> tuple[int, bool, int, int, int]:
    """(prefill group, whether it holds the norm, its activations' bytes, the fixed bytes, drafting's
    charge: draft_bytes' held part and what a verify needs beyond the group's charge) of a plan:
    everything the budget holds before a cache (the MoE plan's experts, the dense plan's resident layers), the group the largest
    whose activations fit beside the rest. A budget below it is one BudgetError naming each part
    (`weights` and `buffers` as (label, bytes): what each plan calls them)."""
    budget = config.ram_budget
    (weights_label, weight_bytes), (buffers_label, buffer_bytes) = weights, buffers
    left = budget - (weight_bytes + kv + buffer_bytes + overhead + transients + prefix)
    # The group is chosen as if drafting were off, and drafting's bytes come out of what follows (the
    # expert cache, whose size changes no bit): a prompt's bits depend on its group (its matmuls' row
    # counts), so decoding with drafts gives exactly the tokens decoding without them gives. Where
    # drafting does not fit beside that group, drafting is refused (DraftBudgetError): a smaller group
    # would change the prompt's bits (a depth-8 lookup engine at 360 MiB prefilled in groups of 64 where
    # the plain one used 128, and its tokens differed).
    group = prefill_group_for(args, config, dtype, left, kv_dtype)
    held = prefill_norm_held(args, group, dtype, config.ctx_size, left)
    prefill = prefill_bytes(args, group, dtype, config.ctx_size, kv_dtype, held)
    charged = _draft_charge(drafting, prefill)
    fixed = weight_bytes + kv + buffer_bytes + overhead + prefill + prefix + charged
    if fixed > budget and fixed - charged <= budget:
        lookup = "" if config.drafter == "lookup" else "draft with prompt lookup alone (drafter lookup) or "
        raise DraftBudgetError(
            f"memory budget {format_size(budget)} leaves {format_size(budget - (fixed - charged))} beside the "
            f"{group}-token prompt groups that decoding without drafts uses; drafting needs {format_size(charged)} "
            f"(a smaller group would change the prompt's bits, and drafting must not change a token): raise the "
            f"budget by {format_size(fixed - budget)}, or {lookup}not at all")
    if fixed > budget:
        raise BudgetError(
            f"memory budget {format_size(budget)} is too small: {weights_label} {format_size(weight_bytes)} + KV "
            f"cache at ctx_size {config.ctx_size} {format_size(kv)} + {buffers_label} {format_size(buffer_bytes)} + "
            f"runtime {format_size(overhead)} + prefill activations ({group}-token groups) {format_size(prefill)} + "
            f"prefix cache {format_size(prefix)} + drafting {format_size(charged)} = {format_size(fixed)}{after}")
    return group, held, prefill, fixed, charged


# (id(ckpt), id(args), quant, dtype) → (ckpt, args, bytes): the cost model plans thousands of
# configs of one checkpoint, and checking every dense tensor each time (DeepSeek-V3: ~450
# quantized matrices) was a third of `colibri plan`. The objects are kept with the figure so an
# id is never reused while its entry lives.
_DENSE_MEMO: dict = {}


def _dense_bytes(ckpt: Checkpoint, args: ModelArgs, quant, dtype: torch.dtype) -> int:
    """Resident bytes of the dense tensors in the compute dtype (quantized ones as stored)."""
    key = (id(ckpt), id(args), quant, dtype)
    hit = _DENSE_MEMO.get(key)
    if hit is not None and hit[0] is ckpt and hit[1] is args:
        return hit[2]
    names = dense_tensor_names(args)
    quantized = dense_quantized(ckpt, quant, names)
    # FP8 checkpoints: the kept projections at 1 byte/weight + fp32 scales; the few dequantized
    # at load (engine/format/fp8_checkpoint.py) in the compute dtype, as every plain tensor.
    fp8_kept, _ = fp8_checkpoint.dense_fp8(ckpt, fp8_checkpoint.fp8_spec(getattr(ckpt, "config", {})), names)
    dense = sum(dense_nbytes(None, quantized[n], _elem(dtype)) if n in quantized
                else fp8_checkpoint.dense_nbytes(fp8_kept[n], _elem(dtype)) if n in fp8_kept
                else _count(ckpt, n) * _elem(dtype) for n in names)
    if len(_DENSE_MEMO) >= 8:
        _DENSE_MEMO.clear()
    _DENSE_MEMO[key] = (ckpt, args, dense)
    return dense


def _layer_names(args: ModelArgs, layer: int) -> list[str]:
    prefix = f"model.layers.{layer}."
    return [n for n in dense_tensor_names(args) if n.startswith(prefix)]


def _dense_plan(ckpt, args, config, dtype, kv, overhead, transients, prefix, drafting, kv_dtype) -> MemoryPlan:
    """Dense model under a budget: as many whole layers resident as fit, the rest streamed."""
    layer_bytes = max(sum(_count(ckpt, n) for n in _layer_names(args, i)) for i in range(args.num_layers)) * _elem(dtype)
    layer_disk = max(sum(ckpt.info(n).nbytes for n in _layer_names(args, i)) for i in range(args.num_layers))
    layered = {n for i in range(args.num_layers) for n in _layer_names(args, i)}
    base = sum(_count(ckpt, n) * _elem(dtype) for n in dense_tensor_names(args) if n not in layered)
    # In flight: the layer being computed and `prefetch_depth` ahead, each as read + converted.
    buffers = (1 + config.prefetch_depth) * (layer_disk + ALIGN_SLACK + (layer_bytes if layer_bytes != layer_disk else 0))
    budget = config.ram_budget
    group, held, prefill, fixed, charged = _fixed_bytes(args, config, dtype, kv_dtype,
                                                        ("dense weights outside the layers", base), kv,
                                                        ("read buffers (layer streaming)", buffers), overhead,
                                                        transients, prefix, drafting)
    resident = min(args.num_layers, int((budget - fixed) * config.cpu_cache_ratio) // max(layer_bytes, 1))
    return MemoryPlan(budget, resident < args.num_layers, base + resident * layer_bytes, kv,
                      buffers if resident < args.num_layers else 0, overhead, 0, 0, 0, 0, 0, 0,
                      resident_layers=resident, layer_bytes=layer_bytes, prefill_bytes=prefill, prefill_group=group,
                      prefill_norm_held=held, prefix_cache_bytes=prefix, draft_bytes=charged)


def _count(ckpt: Checkpoint, name: str) -> int:
    n = 1
    for d in ckpt.info(name).shape:
        n *= d
    return n
