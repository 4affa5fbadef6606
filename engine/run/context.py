"""The context a server gets when none is asked for: the model's own, as far as memory allows.

A fixed default (2048) refused long chats on models trained for 128k, and over-promised nothing
on a model declaring 512. The default is the model's `max_position_embeddings`, capped so that
the KV cache and the prefill pass it implies take at most half of the memory the plan leaves
once the parts that do not depend on the context are counted (engine/movement/plan.py):

    under a budget:  budget - (dense weights outside streamed layers + read buffers + runtime)
    resident:        RAM available now - (dense weights + every expert + a decode step's margin)

The other half stays for what makes decoding fast (the expert cache, resident layers) or for the
rest of the machine. Computed from the checkpoint's index and config, before anything is loaded.
"""

from __future__ import annotations

import os

import psutil
import torch

from engine.arch.args import ModelArgs
from engine.arch.kvquant import kv_storage
from engine.arch import kv_snapshot
from engine.arch.registry import model_args
from engine.base.config import CTX_MAX, PREFILL_CHUNK, EngineConfig
from engine.base.errors import BudgetError
from engine.format.checkpoint import Checkpoint
from engine.format.layout import ExpertLayout
from engine.movement.plan import (ACTIVATION_MARGIN, make_plan, prefill_activation_bytes, prefill_group_bytes,
                                  prefill_tokens_per_pass)
from engine.run.runtime import DTYPE_NAMES, checkpoint_dtype

KV_SHARE = 0.5
ROUND = 256  # a default above this is a multiple of it: a number people recognise in the log


def default_ctx_size(model_dir: str | os.PathLike, config: EngineConfig) -> tuple[int, str]:
    """(ctx_size, why) for `config` on the model in `model_dir`, its ctx_size ignored."""
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    declared = min(int(args.max_position_embeddings or 0) or CTX_MAX, CTX_MAX)
    if config.dtype == "auto":
        d = checkpoint_dtype(ckpt)
        dtype = torch.float32 if d == torch.float16 else d  # as Engine computes it
    else:
        dtype = DTYPE_NAMES[config.dtype]
    kv_dtype = kv_storage(config.kv_dtype, dtype)
    layout = ExpertLayout(ckpt, args) if args.is_moe else None
    try:
        plan = make_plan(ckpt, args, layout, config.replace(ctx_size=1), dtype, kv_dtype)
    except BudgetError:  # not even a 1-token context fits: the engine's own error says why
        return min(declared, 2048), "the memory plan does not fit; its error follows"
    if plan.budget > 0:
        fixed = (plan.overhead_bytes + plan.buffer_bytes + plan.dense_bytes - plan.resident_layers * plan.layer_bytes
                 + plan.prefix_cache_bytes + plan.draft_bytes)
        room = plan.budget - fixed
    else:
        room = psutil.virtual_memory().available - plan.dense_bytes - plan.cache_bytes - ACTIVATION_MARGIN
    limit = int(room * KV_SHARE)
    if _context_bytes(args, config, kv_dtype, dtype, declared) <= limit:
        return declared, "the model's max_position_embeddings"
    lo, hi = 0, declared  # the largest ctx whose KV cache and prefill pass fit in `limit`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _context_bytes(args, config, kv_dtype, dtype, mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return min(declared, 2048), "the memory plan leaves no room for a KV cache; its error follows"
    ctx = lo // ROUND * ROUND if lo >= ROUND else lo
    return ctx, (f"the model declares {declared}; its KV cache would take more than {KV_SHARE:.0%} of the "
                 "memory the plan leaves (set --ctx-size to choose)")


def _context_bytes(args: ModelArgs, config: EngineConfig, kv_dtype, dtype: torch.dtype, ctx: int) -> int:
    """The KV cache at `ctx` (every position kept where the prefix cache needs it) and the least
    prefill the plan charges for it: one sub-chunk's transients and a group of the set size, or of
    one sub-chunk (the default group grows only into room the budget has left)."""
    group = prefill_tokens_per_pass(ctx, config.prefill_chunk or PREFILL_CHUNK)
    return (kv_snapshot.nbytes(args, ctx, kv_dtype, config.prefix_cache > 0)
            + (config.max_batch - 1) * kv_snapshot.nbytes(args, ctx, kv_dtype, False)  # a batch's other sequences
            + prefill_activation_bytes(args, prefill_tokens_per_pass(ctx), dtype, ctx, kv_dtype)
            + prefill_group_bytes(args, group, dtype, ctx))
