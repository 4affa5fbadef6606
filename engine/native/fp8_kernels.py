"""The native FP8 e4m3 decode kernel (fp8_decode.cpp): built on first use like the bf16 ones.

Built into the one native library with the bf16 and MXFP4 kernels (engine/native/__init__.py), so it
loads where they do. Without it (COLIBRI_NATIVE=0, no compiler, another
CPU) FP8 weights are dequantized block-wise and multiplied with F.linear (engine/weights/fp8.py).

    load() -> str | None                   None when ready, else why not (one line)
    ready                                  whether the op is loaded
    linear(x, w, scale, block)             x [M,K] @ dequant(w).T in x's dtype (bf16 or fp32)
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import native




ready = False
_why_not: str | None = None
_tried = False


def load() -> str | None:
    global ready, _why_not, _tried
    if not _tried:
        _tried = True
        _why_not = native.load()  # fp8_decode.cpp is built into the one native library
        ready = _why_not is None
    return _why_not


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return torch.ops.colibri_fp8.linear(x, w, scale, block[0], block[1])
