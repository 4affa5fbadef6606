"""Multi-token-prediction (next-n) layers: recognised in the files; loaded only to draft with.

DeepSeek-V3/R1 and Kimi-K2 ship one MTP module as layer index num_hidden_layers
(`model.layers.61.*` for 61 layers: embed_tokens, enorm, hnorm, eh_proj, shared_head and a full
MoE decoder layer); GLM-4.5/4.6/5 declare theirs with `num_nextn_predict_layers`. They predict
further tokens for speculative decoding: with EngineConfig.draft on and drafter mtp or auto, the
first one is loaded and drafts (engine/arch/mtp.py, engine/run/mtp_drafter.py, charged to the memory
plan). Otherwise they stay on disk: not read, not resident, not in the memory plan, and `run --json`
lists them under "skipped". A checkpoint without them opens the same.
"""

from __future__ import annotations

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_summary(ckpt, args) -> dict:
    """{"mtp_layers": [...], "tensors": n, "bytes": b, "declared": k}: the layers at index
    >= num_hidden_layers present in the files (none: empty list, zero counts)."""
    layers: set[int] = set()
    tensors = nbytes = 0
    for name, info in ckpt.tensors.items():
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= args.num_layers:
            layers.add(int(m.group(1)))
            tensors += 1
            nbytes += info.nbytes
    declared = ckpt.config.get("num_nextn_predict_layers") or 0
    return {"mtp_layers": sorted(layers), "tensors": tensors, "bytes": nbytes,
            "declared": declared if isinstance(declared, int) else 0}
