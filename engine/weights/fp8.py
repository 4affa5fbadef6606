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

import numpy as np
import torch
import torch.nn.functional as F

from engine import native
from engine.base.errors import ModelFormatError
from engine.weights.stored import StoredMatrix

KERNEL_NATIVE = "colibri.fp8_linear (native e4m3 decode)"
KERNEL_TORCH = "fp8 dequantize+linear"
E4M3_MAX = 448.0
NATIVE_MAX_ROWS = 16  # the kernel re-reads the weights once per row: a GEMM wins beyond a few rows


# e4m3fn has no infinities: S.1111.111 (0x7f, 0xff) is its only NaN, and any other code is finite.
NAN_BITS = 0x7F
# The largest weight a block may stand for is 448 x its scale. Trained weights are far below fp16's
# 65504 (published FP8 scales are ~1e-4..1e-2); a scale that makes them larger (3e38 makes them
# overflow fp32 to inf) is a corrupt file, and its products would turn every logit into NaN.
MAX_WEIGHT = 65504.0
MAX_SCALE = MAX_WEIGHT / E4M3_MAX
# Codes sampled per matrix at load: the streaming hot path reads experts per token, so it looks at
# a spread-out subset (a whole projection of NaN codes, the usual corruption, is caught); `convert`
# and `quality` look at every code, and a NaN that slips past the sample stops the run at the
# logits (engine/run/generate.py) instead of emitting token 0.
SAMPLED_CODES = 2048
SAMPLE_RUNS = 32
FULL_CHUNK = 1 << 24  # codes per step of the full check: bounds its copy to 16 MiB


def check_scale_values(scale: torch.Tensor, what: str) -> None:
    """Every scale must be a finite number in [0, MAX_SCALE]: a NaN, infinite, negative or absurd
    scale turns its block into garbage silently. Two numpy reductions: the hot path runs this per
    streamed expert, and numpy's per-call cost is a fraction of torch's; a NaN makes min and max
    NaN, which fails both comparisons."""
    a = scale.detach().numpy()
    if a.size == 0 or (a.min() >= 0 and a.max() <= MAX_SCALE):
        return
    bad = float(a[~((a >= 0) & (a <= MAX_SCALE))][0])
    if math.isnan(bad) or math.isinf(bad) or bad < 0:
        kind = "not a number" if math.isnan(bad) else "infinite" if math.isinf(bad) else "negative"
    else:
        kind = (f"absurd (its weights would reach {bad * E4M3_MAX:.3g}, above {MAX_WEIGHT:g}; "
                f"scales must be <= {MAX_SCALE:.4g})")
    raise ModelFormatError(f"{what}: FP8 block scale {bad:g} is {kind}")


_NAN_CODES = (bytes([NAN_BITS]), bytes([NAN_BITS | 0x80]))


def check_codes(weight: torch.Tensor, what: str, full: bool = False) -> None:
    """No e4m3 NaN code (0x7f / 0xff) in `weight`: every code when `full`, else SAMPLED_CODES of
    them in SAMPLE_RUNS runs of consecutive codes spread evenly over the matrix (runs, not single
    codes: a few dozen cache lines and pages instead of thousands, on a matrix just read). The
    codes are searched as bytes (memchr: no temporaries, GB/s)."""
    codes = (weight if weight.is_contiguous() else weight.contiguous()).view(torch.uint8).numpy().reshape(-1)
    n = codes.size
    run = SAMPLED_CODES // SAMPLE_RUNS
    if full or n <= SAMPLED_CODES:
        spans = [(start, codes[start:start + FULL_CHUNK].tobytes(), 1) for start in range(0, n, FULL_CHUNK)]
    else:
        stride = (n - run) // (SAMPLE_RUNS - 1)
        runs = np.lib.stride_tricks.as_strided(codes, shape=(SAMPLE_RUNS, run), strides=(stride, 1))
        spans = [(0, runs.tobytes(), None)]
    for start, data, step in spans:
        hits = [i for i in (data.find(c) for c in _NAN_CODES) if i >= 0]
        if hits:
            at = min(hits)
            index = start + at if step else (at // run) * stride + at % run
            row, col = divmod(index, weight.shape[-1]) if weight.dim() == 2 else (0, index)
            raise ModelFormatError(f"{what}: FP8 code 0x{int(codes[index]):02x} at [{row}, {col}] is NaN "
                                   "(e4m3 has no NaN weights in a valid checkpoint)")


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
                    what: str, weight_what: str | None = None) -> "Fp8Weight":
        scale = scale if scale.dtype == torch.float32 else scale.float()
        check_scale_values(scale, what)
        check_codes(weight, weight_what or what)
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
