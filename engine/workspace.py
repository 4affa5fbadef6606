"""The decode step's reusable output buffers: sized on first use, then the same memory every token.

One token (T == 1) in bf16 runs the native kernels (engine/native), which can write into a
buffer the caller owns. The buffers named here are each written once per layer and dead
before the next layer writes them again (the fused q/k/v rows are copied into the KV cache
or consumed by the norms and rope, the attention output is added to the residual, the
experts' outputs are summed), so one buffer per name serves every layer of every token.
"""

from __future__ import annotations

import torch

from . import native
from .quant import linear


class Workspace:
    """Named buffers for one Transformer (one decode at a time: not shared across threads)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(shape, dtype=dtype)
        return buf

    def linear(self, name: str, x: torch.Tensor, w) -> torch.Tensor:
        """quant.linear(x, w), into buffer `name` where it takes the native path (the same
        conditions as quant.linear's, so the same kernel and the same bits)."""
        if (native.ready and type(w) is torch.Tensor and x.dim() == 2 and x.shape[0] == 1
                and x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16):
            return native.linear(x, w, out=self.get(name, (1, w.shape[0]), x.dtype))
        return linear(x, w)
