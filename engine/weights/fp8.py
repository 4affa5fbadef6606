"""FP8 e4m3 block-scaled matrices, as the published checkpoints store them (DeepSeek-V3/R1, Kimi-K2,
the FP8 releases of GLM and Qwen3): the math and the weight operator.

Each quantized linear weight [N, K] is F8_E4M3 (1 byte per weight) with one scale per block of
bn rows x bk inputs, the last blocks of a dimension that bn / bk do not divide being partial. The
scale multiplies (DeepSeek's `weight_dequant`):

    w[n, k] = float(fp8[n, k]) * scale_inv[n // bn, k // bk]

"dynamic" activations means the activations are not quantized by the checkpoint: we multiply
bf16/fp32 activations with the stored weights (weight-only, like our int8/int4 containers).

`Fp8Weight` is one such matrix, kept at its stored size: `linear(x)` runs the native e4m3 kernel
(engine/native/fp8_decode.cpp: converts the bytes inside the dot product, no dequantized copy)
for one token, and dequantize-block-wise-then-F.linear for prefill or where native is not loaded.
Reading them from a checkpoint (config.json's quantization_config, the `weight_scale_inv`
tensors, which weights stay FP8) is engine/format/fp8_checkpoint.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native
from engine.base.errors import ModelFormatError
from engine.weights.stored import StoredMatrix

KERNEL_NATIVE = "colibri.fp8_linear (native e4m3 decode)"
KERNEL_TORCH = "fp8 dequantize+linear"
E4M3_MAX = 448.0
NATIVE_MAX_ROWS = 16  # the kernel re-reads the weights once per row: a GEMM wins beyond a few rows


def check_scale_values(scale: torch.Tensor, what: str) -> None:
    """NaN, infinite or negative scales would turn a block into garbage silently."""
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        bad = scale[~torch.isfinite(scale) | (scale < 0)].flatten()[0].item()
        raise ModelFormatError(f"{what}: FP8 block scale {bad} is not a finite non-negative number")


# --- math ------------------------------------------------------------------------------------------

def expand_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] → [N, K]: each block's scale over its (possibly partial) block."""
    n, k = shape
    return scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 [N, K] and its block scales → fp32 [N, K] (DeepSeek's weight_dequant)."""
    return weight.float() * expand_scales(scale, tuple(weight.shape), block)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float → (F8_E4M3 [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]) the way the
    published checkpoints are made: per block, scale = amax / 448 and fp8 = w / scale rounded to
    nearest. Used by tests and benchmarks to write the published layout from a bf16 model."""
    n, k = w.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    amax = padded.reshape(nb, bn, kb, bk).abs().amax(dim=(1, 3))  # [nb, kb]
    scale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w.float() / expand_scales(scale, (n, k), block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass
class Fp8Weight(StoredMatrix):
    """One FP8 block-scaled [N, K] matrix at its stored size; `linear(x)` = x @ W.T."""

    tensor_fields = ("weight", "scale")
    weight: torch.Tensor  # float8_e4m3fn [N, K] (a view of the read buffer when streamed)
    scale: torch.Tensor  # fp32 [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int]

    @classmethod
    def from_stored(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    what: str) -> "Fp8Weight":
        scale = scale if scale.dtype == torch.float32 else scale.float()
        check_scale_values(scale, what)
        return cls(weight, scale.contiguous(), block)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def kernel(self) -> str:
        return KERNEL_NATIVE if native.ready and self.weight.device.type == "cpu" else KERNEL_TORCH

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        # Up to NATIVE_MAX_ROWS rows (decode, short prompts) the native kernel: no dequantized copy,
        # whose fp32 temporaries the allocator keeps (measured: +175 MiB RSS over a 4-token prefill
        # of the 8-layer demo, past a 1 GiB budget). Longer prefills: dequantize, then one GEMM.
        if (native.ready and x.dim() == 2 and x.shape[0] <= NATIVE_MAX_ROWS
                and x.dtype in (torch.bfloat16, torch.float32)
                and self.weight.device.type == "cpu"):
            return native.fp8_linear(x, self.weight, self.scale, self.block)
        return F.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def to(self, device, non_blocking: bool = False) -> "Fp8Weight":
        # The VRAM tier moves cached experts; there the torch fallback computes them.
        return self if torch.device(device).type == "cpu" else self.moved(device, non_blocking)
