"""Engine: load plan, resident or streaming placement, prefill and decode steps.

With no memory budget everything is resident. With a budget, the dense part stays resident and
routed experts stream from disk through the expert store (engine/movement/streaming_experts.py); the memory plan
decides how much RAM the expert cache gets.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter

import psutil
import torch

from engine import native
from engine.base import heap  # first: caps oneDNN's primitive cache before any matmul
from engine.base.hugepages import HugePageArena, arena_bytes
from engine.format.checkpoint import Checkpoint
from engine.format.container import container_spec, dense_quantized, load_dense
from engine.base.config import PREFILL_CHUNK, EngineConfig
from engine.base.dtypes import FLOAT_NAMES, short_dtypes, torch_dtype
from engine.arch.kvquant import kv_storage
from engine.format.layout import ExpertLayout
from engine.arch.args import dense_tensor_names
from engine.arch.registry import model_args
from engine.arch.model import Transformer
from engine.arch.decode_plan import DecodePlan
from engine.movement.plan import MemoryPlan, make_plan, prefill_tokens_per_pass
from engine.arch.router import routing_trim
from engine.format.tensor_checks import check_shapes
from engine.movement.cache import routing_histogram_save
from engine.movement.store import ResidentExperts, WeightStore
from engine.movement.streaming_experts import StreamingExperts
from engine.movement.streaming_layers import StreamingLayers
from engine.weights.quantized import KERNEL_DEQUANT, KERNEL_INT4, KERNEL_INT4_STRIPS, KERNEL_INT8, kernel_works
from engine.base.errors import UnsupportedModelError
from engine.format import fp8_checkpoint
from engine.weights import fp8
from engine.format.checkpoint import read_tensor
from engine.format.mtp import mtp_summary
from engine.format.convert import fingerprint
from engine.arch import kv_snapshot
from engine.run.prefix_cache import copyable, open_prefix_cache
from engine.run.speculative import Speculator
from engine.run.drafting_engine import Drafting
from engine.run import mtp_drafter
from engine.arch import decode_rows
from engine.arch.mtp import with_mtp_layers

DTYPE_NAMES = short_dtypes()


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def checkpoint_dtype(ckpt: Checkpoint) -> torch.dtype:
    name = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype")
    by_config = torch_dtype(name) if name in FLOAT_NAMES else None
    if by_config is not None:
        return by_config
    # FP8 weights are storage, not a compute dtype (their checkpoints say torch_dtype bfloat16).
    floats = [i.torch_dtype for i in ckpt.tensors.values()
              if i.torch_dtype.is_floating_point and i.torch_dtype.itemsize > 1]
    return floats[0] if floats else torch.float32


def _touch_compute_kernels(dtype: torch.dtype, threads: int) -> None:
    """Run each kind of op the forward pass uses once, on toy tensors.

    The memory plan measures the runtime's overhead as the process's RSS; torch maps in its
    kernels (and starts its thread pool) on first use, which adds tens of MiB. Doing that first
    makes the measurement include them instead of surprising the budget later.
    """
    import torch.nn.functional as F
    with torch.inference_mode():
        x = torch.randn(4, 64).to(dtype)
        w = torch.randn(32, 64).to(dtype)
        y = F.silu(F.linear(x, w)) * F.linear(x, w)
        torch.topk(torch.softmax(F.linear(x, w), dim=-1, dtype=torch.float), 2, dim=-1)
        torch.zeros_like(y).index_add_(0, torch.tensor([0, 1]), y[:2])
        q = torch.randn(1, 4, 3, 16).to(dtype)
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))
        F.embedding(torch.tensor([1, 2]), w)
        x.float().pow(2).mean(-1)


def _qkv_adjacent(names: list[str]) -> list[str]:
    """`names` with each attention's k_proj and v_proj weights moved right after its q_proj weight."""
    present = set(names)
    moved = {n for n in names if n.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight"))
             and n[:-len("k_proj.weight")] + "q_proj.weight" in present}
    out = []
    for n in names:
        if n in moved:
            continue
        out.append(n)
        if n.endswith("self_attn.q_proj.weight"):
            out += [m for m in (n[:-len("q_proj.weight")] + "k_proj.weight", n[:-len("q_proj.weight")] + "v_proj.weight")
                    if m in moved]
    return out


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[1] == "layers" else None


class Engine(Drafting):
    """One loaded model, ready to prefill and decode."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig | None = None, *,
                 keep_positions: bool | None = None, kv_dir: str | os.PathLike | None = None, kv_disk_bytes: int = 0,
                 runtime_overhead_bytes: int | None = None):
        """keep_positions: the KV cache holds every position (what reuse restores into; None: when
        config.prefix_cache is on). kv_dir, kv_disk_bytes: the prefix cache's SSD tier (none
        without a directory; engine/run/kv_store.py). runtime_overhead_bytes: the runtime overhead the
        memory plan counts (None: this process's resident set now, plus a decode step's margin). Engines
        compared under one budget take one figure, so their plans differ by their configs alone: a
        process's resident set at planning time varies by a few tenths of a MiB from one start to the
        next, which on a model of small experts (the MTP reference's are 0.38 MiB) is a cache entry."""
        self.config = config or EngineConfig()
        self._runtime_overhead = runtime_overhead_bytes
        keep_positions = self.config.prefix_cache > 0 if keep_positions is None else keep_positions
        self.checkpoint = Checkpoint(model_dir)
        self.args = model_args(self.checkpoint.config)
        self.dtype = self._compute_dtype()
        self.kv_dtype = kv_storage(self.config.kv_dtype, self.dtype)  # a torch dtype, or 'int8' / 'fp8'
        threads = self.config.threads or physical_cores()
        torch.set_num_threads(threads)
        self.threads = threads

        # Validate everything we will read before reading any of it.
        trim = routing_trim(self.args, self.config.top_k_reduction, self.config.expert_threshold)
        container = container_spec(self.checkpoint)
        self.fp8 = fp8_checkpoint.fp8_spec(self.checkpoint.config, f"{self.checkpoint.directory}/config.json")
        self.quant = container or self.fp8  # what run/bench report as `quant`
        # Multi-token-prediction layers in the files: recognised, never read (engine/format/mtp.py).
        self.skipped = mtp_summary(self.checkpoint, self.args)
        dense_names = dense_tensor_names(self.args)
        quantized = dense_quantized(self.checkpoint, container, dense_names)  # checks their own shapes
        # checks their scales
        fp8_kept, fp8_dequantized = fp8_checkpoint.dense_fp8(self.checkpoint, self.fp8, dense_names)
        check_shapes(self.checkpoint, self.args, [n for n in dense_names if n not in quantized])
        self._container = container
        # The MTP layer speculative decoding drafts with (engine/run/mtp_drafter.py), or None: its
        # experts join the layout as layer L, resident or streamed with the rest. The layout exists before
        # the plan (the kernel's choice reads it); the plan (below) may yet drop the layer.
        self.mtp_layer = mtp_drafter.mtp_layer(self.checkpoint, self.args, self.config)
        self._layout_args = with_mtp_layers(self.args, 1 if self.mtp_layer is not None else 0)
        self.layout = ExpertLayout(self.checkpoint, self._layout_args) if self.args.is_moe else None

        # bf16 and int8/int4 decode's native kernels (engine/native): loaded before the overhead is
        # measured; None when loaded, else why torch's matmuls are used instead.
        self.native_unavailable = (native.load() if self.dtype == torch.bfloat16 or self.quant is not None
                                   else "not a bf16 or int8/int4 model")
        # FP8 weights' e4m3 kernel (bf16 or fp32 activations); None when loaded, else why not.
        self.fp8_native_unavailable = native.load() if self.fp8 is not None else "not an FP8 model"
        _touch_compute_kernels(self.dtype, threads)  # so the measured runtime overhead includes them
        self.kernel_name = self.kernel  # tries (and so pages in) a quantized container's packed kernel too
        self.plan: MemoryPlan
        self.plan, self.mtp_layer, self.mtp_window = mtp_drafter.plan_drafting(
            self.checkpoint, self.args, self.config, self.dtype, self.kv_dtype,
            lambda layout_args, mtp_bytes: self._make_plan(layout_args, mtp_bytes, keep_positions))
        t0 = time.perf_counter()
        streamed = self._streamed_layers()
        if streamed and (fp8_kept or fp8_dequantized):  # StreamingLayers casts what it reads; FP8 needs its scales
            raise UnsupportedModelError(f"{model_dir}: streaming the layers of a dense FP8 model is not supported; "
                                        "give a budget that holds it, or convert it first (colibri convert)")
        resident_dense = _qkv_adjacent([n for n in dense_names if _layer_of(n) not in streamed])
        # Every resident dense tensor read straight into one huge-page arena (engine/base/hugepages.py):
        # no second copy, no transient; a layer's q, k, v back to back, so the model's fused q/k/v
        # is a view of them.
        self.dense_arena = HugePageArena(arena_bytes(
            self._dense_bytes(n, quantized, fp8_kept, fp8_dequantized) for n in resident_dense))
        alloc = self.dense_arena.allocator()
        weights = {n: self._load_dense(n, container, quantized, fp8_kept, fp8_dequantized, alloc)
                   for n in resident_dense}
        weights = {n: weights[n] for n in dense_names if n in weights}  # the names' own order
        self.layers = None
        if streamed:
            names = {i: [n for n in dense_names if _layer_of(n) == i] for i in streamed}
            self.layers = StreamingLayers(self.checkpoint, names, self.config, self.dtype)
        if self.layout is None:
            self.experts = None
        elif self.plan.streaming:
            # The MTP layer's bytes, which the expert cache borrows while it is idle (engine/run/mtp_drafter.py)
            lendable = mtp_drafter.loan_bytes(self.checkpoint, self.args, self.mtp_layer, self.dtype, self.kv_dtype,
                                              self.config, self.plan, self.mtp_window)
            self.experts = StreamingExperts(self.layout, self.config, self.plan, self.dtype, lendable_bytes=lendable)
        else:
            self.experts = ResidentExperts(self.layout, self.dtype)
        self.load_seconds = time.perf_counter() - t0
        self.kv = kv_snapshot.allocate(self.args, self.config.ctx_size, self.kv_dtype, self.dtype, keep_positions)
        # The tokens whose K/V the cache holds at positions 0..len-1 (Engine.forward keeps it), and
        # the prefix cache that reuses them and keeps recent ones (engine/run/prefix_cache.py).
        self.kv_tokens: list[int] = []
        self._verify_saved = None  # the ring slots the last verify overwrote (engine/arch/kv_rollback.py)
        self._fingerprint: str | None = None
        self.prefix = open_prefix_cache(self, kv_dir, kv_disk_bytes)
        # Everything that sets how the model runs goes in here, once; the model decides its decode
        # route from it (self.model.plan, engine/arch/decode_plan.py).
        self.model = Transformer(self.args, weights, self.experts, self.dtype, self.kv,
                                 prefetch_depth=self.config.prefetch_depth if self.plan.streaming else 0,
                                 routing_trim=trim, layer_source=self.layers, streamed_layers=streamed)
        # A prefill group holds the MoE's normed input where the plan charged it (plan.prefill_norm_held).
        self.model.prefill_norm_held = self.plan.prefill_norm_held
        # Speculative decoding (engine/run/speculative.py): None when off, so generate decodes as always.
        # The MTP layer's state: the (token, hidden) pairs it reads (engine/run/mtp_drafter.py), kept as
        # forward / rollback see rows; _hidden collects the rows' final hidden states meanwhile.
        self.mtp = (mtp_drafter.open_state(functools.partial(mtp_drafter.load, self, self.mtp_layer), self.experts,
                                           self.mtp_window) if self.mtp_layer is not None else None)
        self._hidden: list | None = [] if self.mtp is not None else None
        self.speculator = Speculator(self) if self.config.draft != "off" else None

    def _make_plan(self, layout_args, mtp_bytes: int, keep_positions: bool) -> MemoryPlan:
        """The memory plan over an expert layout of layout_args (made again where the plan drops the MTP
        layer: engine/run/mtp_drafter.py plan_drafting)."""
        if layout_args is not self._layout_args:
            self._layout_args = layout_args
            self.layout = ExpertLayout(self.checkpoint, layout_args) if self.args.is_moe else None
        return make_plan(self.checkpoint, self.args, self.layout, self.config, self.dtype, self.kv_dtype,
                         overhead_bytes=self._runtime_overhead, keep_positions=keep_positions, mtp_bytes=mtp_bytes)

    def _load_dense(self, name, container, quantized, fp8_kept, fp8_dequantized, alloc=None):
        if name in quantized:
            return load_dense(self.checkpoint, container, quantized[name], self.dtype, alloc)
        if name in fp8_kept:  # 1 byte/weight, multiplied by the e4m3 kernel
            return fp8_checkpoint.load_dense(fp8_kept[name], self.fp8, lambda info: read_tensor(info, alloc))
        if name in fp8_dequantized:  # read as a plain tensor by the model (engine/format/fp8_checkpoint.py says which)
            return fp8_checkpoint.load_dequantized(fp8_dequantized[name], self.fp8, read_tensor, self.dtype)
        return self.checkpoint.load(name, self.dtype, alloc)

    def _dense_bytes(self, name, quantized, fp8_kept, fp8_dequantized) -> int:
        """An upper bound of the arena bytes _load_dense takes for `name` (what is not taken is
        never touched, so never resident)."""
        if name in quantized:
            return arena_bytes(i.nbytes for i in quantized[name])
        if name in fp8_kept:
            return arena_bytes(i.nbytes for i in fp8_kept[name])
        if name in fp8_dequantized:
            return 0
        info = self.checkpoint.info(name)
        return max(info.nbytes, info.nbytes // info.torch_dtype.itemsize * self.dtype.itemsize)

    def _streamed_layers(self) -> list[int]:
        if self.layout is not None or not self.plan.streaming:
            return []
        return list(range(self.plan.resident_layers, self.args.num_layers))

    @property
    def decode_plan(self) -> DecodePlan:
        """The route a decode token takes (native whole step, native per layer, or the reference) and why."""
        return self.model.plan

    @property
    def store(self) -> WeightStore | None:
        """The store behind the weights the model does not hold: experts or layers (None for a
        dense model held whole). `store.streams` says whether a disk is in the loop."""
        return self.experts if self.experts is not None else self.layers

    @property
    def kernel(self) -> str:
        """The matmul the routed experts run through (what run/bench report next to the quant)."""
        if self.fp8 is not None:
            return fp8.KERNEL_TORCH if self.fp8_native_unavailable else fp8.KERNEL_NATIVE + ", prefill: " + fp8.KERNEL_TORCH
        if self.layout is not None and self.layout.kernel is not None:  # the format's own (gpt_oss MXFP4)
            return self.layout.kernel
        if self.quant is None:
            dtype = str(self.dtype).replace('torch.', '')
            build = " (AVX2 build)" if native.isa == "avx2" else ""
            return f"F.linear ({dtype})" if self.native_unavailable else f"F.linear ({dtype}), native bf16 decode{build}"
        a, q = self.args, self.quant
        ok = all(kernel_works(q.quant, n, k, q.group_size, self.dtype)
                 for n, k in ((a.moe_intermediate_size, a.hidden_size), (a.hidden_size, a.moe_intermediate_size)))
        torch_kernel = (KERNEL_INT4 if q.quant == "int4" else KERNEL_INT8) if ok else KERNEL_DEQUANT
        if q.quant == "int4" and native.int_ready:
            return f"{KERNEL_INT4_STRIPS}, decode and prefill"
        on = native.int_ready and native.int8_decode
        return f"native {q.quant} decode (VNNI), prefill: {torch_kernel}" if on else torch_kernel

    def _compute_dtype(self) -> torch.dtype:
        if self.config.dtype == "auto":
            d = checkpoint_dtype(self.checkpoint)
            return torch.float32 if d == torch.float16 else d  # fp16 matmuls are slow on CPU
        return DTYPE_NAMES[self.config.dtype]

    def forward(self, tokens: list[int] | torch.Tensor, start_pos: int, last_only: bool = False) -> torch.Tensor:
        """Logits [T, V] for every position, or [1, V] for the last one (what generation needs).

        last_only: a prompt goes through in groups of the plan's prefill_group tokens, each group one
        layer at a time (Transformer.prefill, engine/arch/prefill.py), so each routed expert is read at
        most once per layer per group and the activations stay within what the memory plan charged
        (engine/movement/plan.py). Without it, one pass of every layer over all T (the reference)."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        del self.kv_tokens[start_pos:]  # rewritten from here; unknown until this call succeeds
        if self.mtp is not None and (last_only or t.shape[0] == 1):
            logits = self._forward_observed(t, start_pos)
        elif not last_only or t.shape[0] == 1:
            logits = self.model.forward(t, start_pos, self.kv, last_only=last_only)
        else:
            logits = self.prefill_into(self.kv, t, start_pos)
        if len(self.kv_tokens) == start_pos:  # positions before start_pos known: these follow them
            self.kv_tokens.extend(t.tolist())
        return logits

    # --- several sequences (engine/arch/decode_rows.py; serve's batch) ----------------------------

    def new_cache(self):
        """A KV cache for another sequence, shaped as the engine's own (ctx_size, kv_dtype): one of the
        config's max_batch, which the memory plan charged. Positions only, no prefix-cache tier."""
        return kv_snapshot.allocate(self.args, self.config.ctx_size, self.kv_dtype, self.dtype, False)

    def prefill_into(self, kv, tokens: list[int] | torch.Tensor, start_pos: int) -> torch.Tensor:
        """The last position's logits [1, V] of tokens written into `kv` at start_pos.., in groups of
        the plan's prefill_group (Transformer.prefill: each routed expert read once per layer per group)."""
        logits = None
        for _done, logits in self.prefill_groups(kv, tokens, start_pos):
            pass
        return logits

    def prefill_groups(self, kv, tokens: list[int] | torch.Tensor, start_pos: int):
        """prefill_into one group at a time: yields (tokens written so far, the group's last logits
        [1, V]) after each (the groups engine/run/batch.py's scheduler passes to prefill_parts)."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        if t.shape[0] == 1:
            yield 1, self.model.forward(t, start_pos, kv)
            return
        group = self.prefill_group_tokens(kv, t.shape[0])
        for begin in range(0, t.shape[0], group):
            logits = self.model.prefill(t[begin:begin + group], start_pos + begin, kv, PREFILL_CHUNK)
            heap.release_freed()  # the group's state and transients, so the next starts from what is live
            yield min(begin + group, t.shape[0]), logits

    def prefill_group_tokens(self, kv, prompt_tokens: int) -> int:
        """Tokens per group of a prompt of `prompt_tokens` new tokens written into `kv`: the groups
        prefill_groups cuts (the plan's prefill_group, or the whole prompt)."""
        return prefill_tokens_per_pass(kv.ctx_size, self.plan.prefill_group or prompt_tokens)

    def prefill_parts(self, parts: list[tuple[object, list[int] | torch.Tensor, int]]) -> list[torch.Tensor]:
        """Groups of several sequences in one pass: parts [(kv, tokens, start_pos)] → each one's last
        logits [1, V], each routed expert read once per layer for all (Transformer.prefill_parts). The
        caller keeps their total within the plan's group (what the plan charged); one part alone
        has the bits prefill_groups gives that group."""
        logits = self.model.prefill_parts([(torch.as_tensor(t, dtype=torch.long), pos, kv) for kv, t, pos in parts],
                                          PREFILL_CHUNK)
        heap.release_freed()  # the group's state and transients, so the next starts from what is live
        return logits

    def decode_rows(self, tokens: list[int] | torch.Tensor, positions: list[int], kvs: list) -> torch.Tensor:
        """fp32 logits [B, V]: row b one token at positions[b] of cache kvs[b] (the engine's own or
        new_cache()'s), each with its solo decode's bits, each routed expert fetched once for the rows."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        own = [b for b, kv in enumerate(kvs) if kv is self.kv]  # consecutive positions (decode_rows checks)
        if own:
            del self.kv_tokens[positions[own[0]]:]  # rewritten from here, as forward does
        # the MTP drafter reads a verify's rows once rollback says which were accepted
        hidden = self._hidden if self._hidden is not None and len(own) == len(kvs) else None
        logits = decode_rows.forward_rows(self.model, t, list(positions), list(kvs), hidden=hidden)
        if own and len(self.kv_tokens) == positions[own[0]]:
            self.kv_tokens.extend(t[own].tolist())
        return logits

    # --- prefix reuse (engine/run/prefix_cache.py) -----------------------------------------------

    @property
    def fingerprint(self) -> str:
        """The checkpoint's identity (config.json, every shard's size and header), read once when
        reuse first needs it: cached KV is keyed by it."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.checkpoint)
        return self._fingerprint

    def restore_prefix(self, ids: list[int], kv=None, kv_tokens: list[int] | None = None) -> int:
        """Make the KV cache hold the longest prefix of `ids` it can without computing (at most
        len(ids) - 1 tokens: the last one's logits are needed) and return its length.

        kv, kv_tokens: another cache (a batched sequence's, new_cache()) and the tokens whose K/V it
        holds at positions 0.. (updated here); None: the engine's own. A cache whose positions cannot
        be copied (a sliding layer's ring) reuses nothing."""
        kv, kv_tokens = (self.kv, self.kv_tokens) if kv is None else (kv, kv_tokens)
        if self.prefix is None or not copyable(kv):
            return 0
        reused = self.prefix.restore(ids, kv_tokens, kv)
        del kv_tokens[reused:]
        kv_tokens[:reused] = ids[:reused]
        return reused

    def remember_prefix(self, kv=None, kv_tokens: list[int] | None = None) -> None:
        """Keep the blocks of what the KV cache (the engine's own, or `kv` holding `kv_tokens`) holds
        now, for later prompts that share them."""
        kv, kv_tokens = (self.kv, self.kv_tokens) if kv is None else (kv, kv_tokens)
        if self.prefix is not None and copyable(kv):
            self.prefix.remember(kv_tokens, kv)

    def prefix_stats(self) -> dict:
        """The prefix cache's counters (lookups, hits, cached tokens, bytes restored, spilled): {} when off."""
        return self.prefix.metrics() if self.prefix is not None else {}

    def forget_prefixes(self) -> None:
        """Nothing computed before is reused (a cold measurement): the live positions and the RAM blocks."""
        del self.kv_tokens[:]
        if self.prefix is not None:
            self.prefix.clear()

    def record_routing(self) -> None:
        """Start logging every routing decision (for --record-routing / cache_policy=pinned)."""
        self.model.record_routing()

    def save_routing(self, path) -> None:
        """Write the (layer, expert) → count histogram of what was routed since record_routing()."""
        hist: Counter = Counter()
        for layer, calls in enumerate(self.model.routing_log or []):
            for ids in calls:
                hist.update((layer, e) for e in ids.flatten().tolist() if e >= 0)  # -1: a skipped slot
        routing_histogram_save(hist, path)

    def io_stats(self) -> dict:
        store = self.store
        return store.stats() if store is not None and store.streams else {}

    def close(self) -> None:
        if self.prefix is not None:
            self.prefix.close()
            self.prefix = None
        if self.store is not None:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
