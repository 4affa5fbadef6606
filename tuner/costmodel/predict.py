"""Predicted decode tok/s, TTFT, bytes read and the bottleneck of one config.

A decode token costs (seconds):

    fixed      c_layer · layers                       per-layer Python and dispatch work
    compute    max(weight bytes touched / memory bandwidth(threads),
                   2 · active params / kernel FLOP/s(quant, m=1, threads, shape)
                   + expert reads · 3 · prepare time(quant, shape)) / eta_compute
    disk       (bytes read / read bandwidth(request size, queue depth, io mode)
                + buffered only: bytes read / one thread's copy bandwidth, the kernel's copy) / eta_io
               + page-cache bytes · c_page[io mode]           (buffered, mmap: cgroup reclaim, faults)
    requests   read requests · c_request                  submission, completion, hand-off
    hidden     − min(lookahead-covered share of disk, overlap · compute)   (prefetch_depth ≥ 1)

The measured inputs come from the profile (hardware.py), the byte and request counts from the
engine's memory plan (memplan.py), the read pool's splitting (read_requests) and the cache
simulation (routing.py; in mmap mode the page cache's recency order, residency_policy). The few efficiency
factors (Factors) are what calibration fits to a study's trials; uncalibrated they are 1 and 0,
i.e. the machine's measured curves exactly, with no overhead, and reads that lookahead issued
early hide behind the compute (overlap 1).

The split into factor-free `Components` and `combine(components, factors)` is what makes
calibration cheap: components are computed once per trial, the fit only recombines them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from engine.api import BLOCK_TOKENS, BudgetError, EngineConfig

from tuner.costmodel.model_geometry import ModelGeometry
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.memplan import plan_memory, planning_args
from tuner.costmodel.routing_model import RoutingModel, simulate

# Published figure for router lookahead (Colibrì on GLM-5: 71.6% of the true top-8), used when
# no study measured this model's recall.
DEFAULT_LOOKAHEAD_RECALL = 0.716
BOTTLENECKS = ("disk", "memory", "compute", "overhead")


@dataclass
class Factors:
    eta_io: float = 1.0  # share of the probe's read bandwidth the engine's reads achieve
    eta_compute: float = 1.0  # share of the probe's memory bandwidth / matmul rate compute achieves
    # Share of compute time that can hide lookahead reads. 1 by default: the engine's reads run on
    # the read pool's own threads (or io_uring's) while the compute thread works through the
    # layers between a hint and its use, so a lookahead read can hide behind all of that compute
    # (the physically perfect overlap, as eta 1 and overheads 0 are the measured curves exactly).
    # Fitted only where some prefetching trial is compute-bound enough to inform it (calibrate.informed).
    overlap: float = 1.0
    c_request: float = 0.0  # seconds per read request
    c_layer: float = 0.0  # seconds per layer per forward pass
    # Seconds per byte a read through the page cache costs beyond the probe's figure for it:
    # page allocation and reclaim inside the trial's memory cgroup (the probe reads buffered once,
    # with no memory limit), and for mmap the page-table work of faulting the pages in (the probe
    # never maps). 0 for direct reads, which bypass the page cache.
    c_page_buffered: float = 0.0
    c_page_mmap: float = 0.0
    lookahead_recall: float = DEFAULT_LOOKAHEAD_RECALL  # measured by the trials, not fitted

    FITTED = ("eta_io", "eta_compute", "overlap", "c_request", "c_layer", "c_page_buffered", "c_page_mmap")

    def page_cost(self, io_mode: str) -> float:
        return {"buffered": self.c_page_buffered, "mmap": self.c_page_mmap}.get(io_mode, 0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Factors":
        known = {k: float(v) for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class RunConditions:
    """How the figure is measured: the tuner's trial (cold, short) or a steady state.

    The defaults are the tuner's trial, `colibri bench` (engine/run/bench.py): a warm-up generation
    of 2 tokens, then `repeats` runs of the same prompt, greedily decoded, so every run asks the
    same experts in the same order (`replay`); cold empties the caches before each run.
    """

    prompt_tokens: int = 8
    tokens: int = 8
    repeats: int = 2
    cold: bool = True
    warmup_tokens: int = 0  # unmeasured tokens at the start of a warm run's one long generation
    replay: bool = True
    prelude_tokens: int = 2  # engine/run/bench.py's run_bench(warmup_tokens=2)

    @classmethod
    def steady(cls) -> "RunConditions":
        """Long generation with a warm cache: what a user's chat session settles to (32 tokens
        measured after 32 unmeasured ones: enough lookups for a stable hit rate)."""
        return cls(prompt_tokens=16, tokens=32, repeats=1, cold=False, warmup_tokens=32, replay=False,
                   prelude_tokens=0)


@dataclass
class Components:
    """Factor-free costs of one config (seconds unless named otherwise)."""

    layers: int
    compute_s: float  # decode token at eta_compute = 1
    compute_is_memory: bool  # memory bandwidth, not FLOP/s, bounds the compute
    disk_s: float  # decode token's reads at eta_io = 1
    requests: float  # decode token's read requests
    covered: float  # share of the decode reads the lookahead issues early (0 without prefetch)
    prefill_compute_s: float
    prefill_disk_s: float
    prefill_requests: float
    io_mode: str = "direct"
    page_bytes: float = 0.0  # decode bytes read through the page cache (buffered, mmap)
    prefill_page_bytes: float = 0.0
    prefill_read_bytes: float = 0.0  # the prompt's expert bytes read, every group's union
    prefill_groups: int = 1  # layer-major groups the prompt goes through (engine/arch/prefill.py)


@dataclass
class Prediction:
    fits: bool
    reason: str = ""
    plan: dict = field(default_factory=dict)
    hit_rate: float | None = None
    bytes_per_token: float | None = None
    decode_tok_s: float | None = None
    ttft_s: float | None = None
    bottleneck: str | None = None
    seconds: dict = field(default_factory=dict)  # the decode token's terms
    read_request_bytes: int | None = None
    queue_depth: int | None = None
    components: Components | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("components")
        return d


def components(geometry: ModelGeometry, quant: str, config: EngineConfig, hw: HardwareView, routing: RoutingModel,
               run: RunConditions, overhead_bytes: int, lookahead_recall: float, seed: int = 0):
    """(plan, hit rates, Components, request size, queue depth); raises BudgetError if it cannot fit."""
    plan = plan_memory(geometry, quant, config, overhead_bytes)
    slots = (plan.cache_bytes + plan.gpu_cache_bytes) // max(plan.expert_bytes, 1) if plan.streaming else None
    k = geometry.top_k
    if plan.streaming and geometry.routed_experts:
        rates = _simulate_once(routing, k, int(slots), config.cache_policy, run,
                               lookahead_recall if config.prefetch_depth > 0 else None, seed)
    else:
        rates = None
    disk_rates = rates
    resident_by = residency_policy(config.io_mode, config.cache_policy)
    if rates is not None and resident_by != config.cache_policy:
        disk_rates = _simulate_once(routing, k, int(slots), resident_by, run,
                                    lookahead_recall if config.prefetch_depth > 0 else None, seed)
    span = plan.expert_disk_bytes
    reads = (disk_rates.decode_misses_per_token + disk_rates.wasted_prefetch_per_token) if rates else 0.0
    per_expert, request = read_requests(span, config.chunk_size, config.io_threads)
    # Requests a layer has in flight: its misses' pieces plus the lookahead's, capped by the pool.
    per_layer = reads / max(geometry.moe_layers, 1) * per_expert * (1 + min(config.prefetch_depth, 1))
    qd = max(1, min(config.io_threads, math.ceil(per_layer)))
    bw = hw.read_bandwidth(request, qd, config.io_mode)
    threads = config.threads or hw.physical_cores

    wbytes = weight_bytes_touched(geometry, quant)
    t_mem = wbytes / hw.memory_bandwidth(threads)
    # Each expert read from disk is turned into its kernel's operand once (QuantWeight.prepare).
    t_prepare = reads * 3 * hw.prepare_seconds(quant, geometry.hidden_size, geometry.moe_intermediate_size)
    t_flop = flop_seconds(geometry, quant, hw, 1, threads) + t_prepare

    # Prefill: the prompt's rows share each weight read; experts are the prompt's union, read once per
    # layer per layer-major group (engine/arch/prefill.py). A prompt longer than the plan's group
    # goes through in several, each reading its own union: counted as the prompt's again (a group
    # of hundreds of tokens routes to nearly every expert of a layer; the cache's few hits aside).
    P = run.prompt_tokens
    groups = math.ceil(P / plan.prefill_group) if plan.prefill_group else 1
    pf_reads = (disk_rates.prefill_misses_per_layer * geometry.moe_layers * groups) if rates else 0.0
    pf_per_layer = (disk_rates.prefill_misses_per_layer if rates else 0.0) * per_expert
    pf_bw = hw.read_bandwidth(request, max(1, min(config.io_threads, math.ceil(pf_per_layer))), config.io_mode)
    union = min(geometry.num_experts, (rates.prefill_misses_per_layer if rates else k))
    pf_bytes = wbytes + geometry.moe_layers * max(union - k, 0) * geometry.expert_bytes(quant)
    pf_mem = pf_bytes / hw.memory_bandwidth(threads)
    pf_flop = flop_seconds(geometry, quant, hw, P, threads) + pf_reads * 3 * hw.prepare_seconds(
        quant, geometry.hidden_size, geometry.moe_intermediate_size)
    # A buffered read is the disk's transfer plus the kernel's copy into our buffer.
    copy = 1.0 / hw.copy_bandwidth() if config.io_mode == "buffered" else 0.0
    comps = Components(
        layers=geometry.num_layers, compute_s=max(t_mem, t_flop), compute_is_memory=t_mem >= t_flop,
        disk_s=reads * span * (1.0 / bw + copy) if bw else math.inf, requests=reads * per_expert,
        covered=lookahead_recall if config.prefetch_depth > 0 else 0.0,
        prefill_compute_s=max(pf_mem, pf_flop), prefill_disk_s=pf_reads * span * (1.0 / pf_bw + copy) if pf_bw else math.inf,
        prefill_requests=pf_reads * per_expert, io_mode=config.io_mode,
        page_bytes=0.0 if config.io_mode == "direct" else reads * span,
        prefill_page_bytes=0.0 if config.io_mode == "direct" else pf_reads * span,
        prefill_read_bytes=pf_reads * span, prefill_groups=groups,
    )
    return plan, rates, comps, request, qd


def residency_policy(io_mode: str, cache_policy: str) -> str:
    """Whose order decides which experts stay in RAM, so what the disk reads.

    An mmap cache entry is a view of page-cache pages, which the engine does not lock: the
    kernel keeps or reclaims them by its own recency order, so the disk reads what an LRU of
    the same room misses, whatever the engine's policy counts as a hit (measured: lfu trials at
    37-43% hits decoded no faster than lru ones at 0%, docs/benchmarks-history.md, calib2).
    pread modes copy into the engine's own slots, which stay until the policy evicts them."""
    return "lru" if io_mode == "mmap" else cache_policy


def read_requests(span: int, chunk_size: int, io_threads: int) -> tuple[int, int]:
    """(requests, bytes each) of one expert span, as engine/movement/io/pool.py's ReadPool issues them: one
    request per span, split across the workers only when the span exceeds chunk_size — into
    min(io_threads, ceil(span / chunk_size)) equal pieces (page-aligned; the alignment is ignored)."""
    if not span:
        return 0, chunk_size
    pieces = max(1, min(io_threads, -(-span // max(chunk_size, 1))))
    return pieces, -(-span // pieces)


_SIMULATED: dict = {}


def _simulate_once(routing: RoutingModel, k: int, slots: int, policy: str, run: RunConditions,
                   recall: float | None, seed: int):
    """simulate(), memoized: a search plans thousands of configs but few distinct caches.

    Cache sizes are snapped to a 2% geometric grid first, so configs whose caches differ by a
    slot or two (read buffers of another prefetch depth) share one simulation.
    """
    if slots > 50:
        slots = int(round(1.02 ** round(math.log(slots, 1.02))))
    key = (id(routing), k, slots, policy, run.prompt_tokens, run.tokens, run.repeats, run.cold,
           run.warmup_tokens, run.replay, run.prelude_tokens, recall, seed)
    if key not in _SIMULATED:
        if len(_SIMULATED) > 4096:
            _SIMULATED.clear()
        _SIMULATED[key] = (routing, simulate(routing, k, slots, policy, prompt_tokens=run.prompt_tokens,
                                             tokens=run.tokens, repeats=run.repeats, cold=run.cold,
                                             warmup_tokens=run.warmup_tokens, lookahead_recall=recall, seed=seed,
                                             replay=run.replay, prelude_tokens=run.prelude_tokens,
                                             pinned_from=routing.sample_routings))
    return _SIMULATED[key][1]


def flop_seconds(geometry: ModelGeometry, quant: str, hw: HardwareView, m: int, threads: int) -> float:
    """Matmul seconds of a forward pass over `m` rows: the routed experts' projections at the
    expert shape [moe_intermediate, hidden], the resident matrices at [hidden, hidden], each at the
    measured rate of the kernel that computes that weight format (hardware.kernel_flops)."""
    H, I = geometry.hidden_size, geometry.moe_intermediate_size
    expert = geometry.moe_layers * geometry.top_k * geometry.expert_params
    dense = max(geometry.active_params - expert, 0)
    return (2 * m * expert / hw.kernel_flops(quant, m, threads, H, I)
            + 2 * m * dense / hw.kernel_flops(quant, m, threads, H, H))


def weight_bytes_touched(geometry: ModelGeometry, quant: str) -> float:
    """Bytes the matmuls of one decode token read: resident weights but the embedding table
    (one row is gathered), plus top_k experts per MoE layer."""
    key = ("weight_bytes_touched", quant)
    if key not in geometry.memo:
        embed = next((t for t in geometry.dense if t.name == "model.embed_tokens.weight"), None)
        dense = geometry.dense_bytes(quant) - (embed.nbytes(quant) if embed else 0)
        geometry.memo[key] = dense + geometry.moe_layers * geometry.top_k * geometry.expert_bytes(quant)
    return geometry.memo[key]


def combine(c: Components, f: Factors) -> dict:
    """Seconds of each decode term, TTFT, and the bottleneck, for these factors."""
    fixed = f.c_layer * c.layers
    compute = c.compute_s / f.eta_compute
    page = f.page_cost(c.io_mode)
    disk = c.disk_s / f.eta_io + c.page_bytes * page
    requests = f.c_request * c.requests
    hidden = min(c.covered * disk, f.overlap * compute)
    total = fixed + compute + disk + requests - hidden
    exposed_disk = disk - hidden
    terms = {"disk": exposed_disk, "memory" if c.compute_is_memory else "compute": compute,
             "overhead": fixed + requests}
    bottleneck = max(terms, key=terms.get)
    ttft = (fixed + c.prefill_compute_s / f.eta_compute + c.prefill_disk_s / f.eta_io + c.prefill_page_bytes * page
            + f.c_request * c.prefill_requests)
    return {"token_s": total, "ttft_s": ttft, "bottleneck": bottleneck,
            "terms": {"fixed": fixed, "compute": compute, "disk": disk, "requests": requests, "hidden": -hidden}}


def predict(geometry: ModelGeometry, quant: str, config: EngineConfig, hw: HardwareView, routing: RoutingModel,
            factors: Factors | None = None, run: RunConditions | None = None, overhead_bytes: int = 0,
            seed: int = 0) -> Prediction:
    factors = factors or Factors()
    run = run or RunConditions()
    try:
        plan, rates, comps, request, qd = components(geometry, quant, config, hw, routing, run, overhead_bytes,
                                                     factors.lookahead_recall, seed)
    except BudgetError as exc:
        return Prediction(False, reason=str(exc))
    out = combine(comps, factors)
    reads = (rates.decode_misses_per_token + rates.wasted_prefetch_per_token) if rates else 0.0
    return Prediction(
        True, plan=plan.to_dict(), hit_rate=rates.decode if rates else 1.0,
        bytes_per_token=reads * plan.expert_disk_bytes, decode_tok_s=1.0 / out["token_s"] if out["token_s"] > 0 else None,
        ttft_s=out["ttft_s"], bottleneck=out["bottleneck"], seconds={k: round(v, 6) for k, v in out["terms"].items()},
        read_request_bytes=int(request), queue_depth=qd, components=comps,
    )


# --- time to first token of N new tokens after M cached ones ---------------------------------------

# sha256 over a KV file's data (engine/run/kv_store.py checks it before using a block): one core's
# rate on a current x86 (hashlib, SHA-NI), not probed.
SHA256_BYTES_PER_S = 1.5e9


def predict_prefill(geometry: ModelGeometry, quant: str, config: EngineConfig, hw: HardwareView, routing: RoutingModel,
                    factors: Factors, new_tokens: int, cached_tokens: int = 0, overhead_bytes: int = 0,
                    seed: int = 0) -> dict:
    """Seconds to the first token of a prompt whose first `cached_tokens` positions are reused
    (engine/run/prefix_cache.py) and whose `new_tokens` are prefilled, cold, and what they are:

        reads      the experts each layer-major group routes to, not cached (the routing model's
                   union for new_tokens), at the read curve, as the decode's disk term
        compute    the group's matmuls over new_tokens rows (as the decode's compute term), plus
                   attention: each new token's scores and weighted sum over every position before
                   it, cached ones included (2 · heads · (qk + v dims) FLOPs per pair, per layer)
        restore    the cached positions' KV (every layer's, as the prefix cache keeps it) copied
                   from RAM blocks, or where the prefix cache's share cannot hold them, read from
                   the SSD tier's files (buffered, one block file a request), checksummed, copied

    A conversation's next turn, which resends the history just computed, restores nothing (the
    positions are still in the engine's KV cache); `restore_from` says which case the figure is.
    The context grows to hold both parts where the config's is smaller."""
    new, cached = max(1, int(new_tokens)), max(0, int(cached_tokens))
    if config.ctx_size < new + cached:
        config = config.replace(ctx_size=new + cached)
    run = RunConditions(prompt_tokens=new, tokens=1, repeats=1, cold=True, replay=False, prelude_tokens=0)
    try:
        plan, _rates, c, _request, _qd = components(geometry, quant, config, hw, routing, run, overhead_bytes,
                                                    factors.lookahead_recall, seed)
        # Every position of every layer, as a prefix block holds them (keep_positions).
        kept = plan_memory(geometry, quant, config.replace(prefix_cache=max(config.prefix_cache, 1)), overhead_bytes)
    except BudgetError as exc:
        return {"fits": False, "reason": str(exc), "new_tokens": new, "cached_tokens": cached}
    threads = config.threads or hw.physical_cores
    attention_s = _attention_seconds(geometry, hw, threads, new, cached)
    restore_bytes = cached * kept.kv_bytes / config.ctx_size
    block = restore_bytes / max(cached, 1) * BLOCK_TOKENS  # one block, one SSD file
    ram_s = restore_bytes / hw.copy_bandwidth()
    ssd_s = (restore_bytes / hw.read_bandwidth(block, 1, "buffered") + restore_bytes / SHA256_BYTES_PER_S + ram_s
             if restore_bytes else 0.0)
    source = "none" if not cached else "ram" if config.prefix_cache >= restore_bytes else "ssd"
    f = factors
    fixed = f.c_layer * c.layers
    compute = (c.prefill_compute_s + attention_s) / f.eta_compute
    reads = (c.prefill_disk_s / f.eta_io + c.prefill_page_bytes * f.page_cost(c.io_mode)
             + f.c_request * c.prefill_requests)
    restore = {"none": 0.0, "ram": ram_s, "ssd": ssd_s}[source]
    return {"fits": True, "new_tokens": new, "cached_tokens": cached, "groups": c.prefill_groups,
            "prefill_group": plan.prefill_group, "read_bytes": round(c.prefill_read_bytes),
            "read_s": reads, "compute_s": compute, "attention_s": attention_s / f.eta_compute, "overhead_s": fixed,
            "restore_bytes": round(restore_bytes), "restore_from": source, "restore_ram_s": ram_s,
            "restore_ssd_s": ssd_s, "restore_s": restore, "ttft_s": fixed + compute + reads + restore}


def _attention_seconds(geometry: ModelGeometry, hw: HardwareView, threads: int, new: int, cached: int) -> float:
    """Matmul seconds of `new` queries' attention over the positions before each (cached ones
    included), every layer, at the bf16 F.linear rate of `new` rows. Sliding windows are not
    discounted (an upper bound for gpt-oss)."""
    args = planning_args(geometry)
    impl = args.attention_impl
    if impl is not None and hasattr(impl, "kv_lora_rank"):  # MLA: absorbed, over the latents
        qk, v = impl.kv_lora_rank + impl.qk_rope_head_dim, impl.kv_lora_rank
    else:
        qk = v = args.head_dim
    pairs = new * cached + new * (new + 1) / 2
    flops = 2 * args.num_layers * args.num_heads * (qk + v) * pairs
    return flops / hw.matmul_flops("bf16", new, threads)

