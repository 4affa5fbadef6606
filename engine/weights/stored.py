"""The contract every weight the forward pass multiplies by meets, and the one call that multiplies.

A weight is either a plain tensor (bf16 / fp32 as the checkpoint has it) or a `StoredMatrix`: a
matrix kept in its stored form, codes plus scales, multiplied by its own kernel without a
dequantized copy: int8 / int4 (quantized.QuantWeight), FP8 e4m3 block-scaled (fp8.Fp8Weight),
MXFP4 (mxfp4.Mxfp4Matrix). `linear(x, w, bias)` is x @ w.T (+ bias) for any of them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine import native


class StoredMatrix:
    """What every matrix kept in its stored form shares: int8/int4 (quantized.QuantWeight), FP8 block-scaled
    (fp8.Fp8Weight) and MXFP4 (mxfp4.Mxfp4Matrix) are codes plus scales multiplied by their
    own kernel; the store and the VRAM tier need only their device, their bytes, and a copy on
    another device. Each names the dataclass fields that hold its tensors, codes first."""

    tensor_fields: ClassVar[tuple[str, ...]]

    @property
    def device(self) -> torch.device:
        return getattr(self, self.tensor_fields[0]).device

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self.tensor_fields)

    def moved(self, device, non_blocking: bool = False, **changes):
        """The same matrix with its tensors on `device` (and any other field changed)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in self.tensor_fields}
        return dataclasses.replace(self, **moved, **changes)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a plain weight tensor or a QuantWeight (or FP8 Fp8Weight). MXFP4 experts
    take their bias inside their kernel: gpt-oss's experts call Mxfp4Matrix.linear(x, bias) themselves.

    One bf16 row (decode) goes through the native kernel when it is loaded (engine/native): the
    same bits as F.linear in our tests, at about 3x the weight bandwidth. A bf16 bias is added
    inside it before the one rounding, as F.linear's addmm rounds (adding it after would round
    twice); its rows are row-independent, so a batched step's rows (decode_rows.py) keep these bits."""
    if isinstance(w, torch.Tensor):  # else a stored-quantized matrix: QuantWeight, fp8.Fp8Weight
        if (native.ready and x.dim() == 2 and x.shape[0] == 1 and x.dtype is torch.bfloat16
                and w.dtype is torch.bfloat16 and (bias is None or bias.dtype is torch.bfloat16)):
            return native.linear(x, w, bias)
        return F.linear(x, w, bias)
    y = w.linear(x)
    return y if bias is None else y + bias
