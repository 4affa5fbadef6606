"""Weight-only quantization: int8 per output row and int4 group-wise, and their CPU kernels.

    int8   w[n, k] ≈ codes[n, k] * scale[n]                      symmetric, one scale per row
    int4   w[n, k] ≈ (codes[n, k] - 8) * scale[g, n] + zero[g, n]   g = k // group_size

The int4 form is the one torch's CPU kernel `_weight_int4pack_mm_for_cpu` computes (scale and
zero interleaved as `scales_zeros[K/group, N, 2]`), so the stored figures feed it directly;
with zero = min + 8 * scale, the codes 0..15 span each group's [min, max] (asymmetric).
int8 is what `_weight_int8pack_mm` computes (codes [N, K], scales [N]).

Scales and zeros are rounded to bf16 *before* the codes are chosen, so the codes are the best
ones for the scales actually stored (rounding afterwards would add a second error).

`QuantWeight` is one quantized matrix ready to multiply: it holds the kernel's operands, and
`linear(x)` runs the packed kernel where it applies, dequantize-then-matmul otherwise. Which
kernel applies is tried once per (kind, shape, dtype) on a zero tensor, because the packed
ops' limits differ by torch build and CPU (see `kernel_works`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine import native
from engine.base.errors import ModelFormatError

QUANTS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPE = torch.bfloat16  # stored dtype of scales and zeros
INT4_MID = 8  # the kernel subtracts 8 from every code

KERNEL_INT8 = "aten._weight_int8pack_mm"
KERNEL_INT4 = "aten._weight_int4pack_mm_for_cpu"
KERNEL_DEQUANT = "dequantize+linear"


# --- quantize / dequantize (fp32 math; what convert runs) --------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float → codes int8 [N, K], scales bf16 [N] (absmax per row / 127)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).to(SCALE_DTYPE)
    codes = torch.round(wf / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float → codes uint8 [N, K/2] in the blocked layout (pack_int4),
    scales_zeros bf16 [K/group, N, 2]."""
    N, K = w.shape
    check_group(K, group_size, "weight")
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)  # [N, G]
    scale = ((hi - lo) / 15.0).clamp_min(1e-8).to(SCALE_DTYPE).float()
    zero = (lo + INT4_MID * scale).to(SCALE_DTYPE).float()
    codes = torch.round((g - zero[..., None]) / scale[..., None] + INT4_MID).clamp_(0, 15).to(torch.uint8)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(SCALE_DTYPE)
    return pack_int4(codes.reshape(N, K)), scales_zeros


# The stored int4 layout is the one torch's AVX512 kernel reads (`_convert_weight_to_int4pack_for_cpu`
# with CPU_CAPABILITY_AVX512), written here in tensor ops so that a container is the same bytes
# whatever machine converted it: rows in blocks of 64, k-major inside a block, byte j of (block, k)
# = row j (low nibble) | row j + 32 (high nibble); a last block of fewer than 64 rows pairs rows
# n, n + 1. On that CPU the stored bytes are the kernel's operand as is (docs/FORMAT.md: repacking
# at load costs 20-60 ms per demo expert against ~1 ms of compute).
INT4_BLOCK = 64


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes 0..15 uint8 [N, K] → uint8 [N, K/2] in the blocked layout."""
    N, K = codes.shape
    if N % 2 or K % 2:
        raise ModelFormatError(f"int4 weight [{N}x{K}]: both dimensions must be even")
    full = N - N % INT4_BLOCK
    parts = []
    if full:
        b = codes[:full].reshape(full // INT4_BLOCK, INT4_BLOCK, K)
        half = INT4_BLOCK // 2
        parts.append((b[:, :half] | (b[:, half:] << 4)).transpose(1, 2).reshape(-1))  # [NB, K, 32]
    if full < N:
        r = codes[full:].reshape(-1, 2, K)
        parts.append((r[:, 0] | (r[:, 1] << 4)).transpose(0, 1).reshape(-1))  # [K, rows/2]
    return torch.cat(parts).reshape(N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the blocked layout → codes 0..15 as uint8 [N, K]."""
    N, K = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    full = N - N % INT4_BLOCK
    rows = []
    if full:
        half = INT4_BLOCK // 2
        b = flat[: full * K // 2].reshape(full // INT4_BLOCK, K, half).transpose(1, 2)  # [NB, 32, K]
        rows.append(torch.cat([b & 0xF, b >> 4], dim=1).reshape(full, K))
    if full < N:
        r = flat[full * K // 2:].reshape(K, (N - full) // 2).transpose(0, 1)  # [rows/2, K]
        rows.append(torch.stack([r & 0xF, r >> 4], dim=1).reshape(N - full, K))
    return torch.cat(rows)


def dequantize_int4(packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    codes = unpack_int4(packed).float()  # [N, K]
    N, K = codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, G, 2]
    g = codes.reshape(N, K // group_size, group_size)
    return ((g - INT4_MID) * sz[..., 0:1] + sz[..., 1:2]).reshape(N, K)


def check_group(k: int, group_size: int, what: str) -> None:
    if group_size not in GROUP_SIZES:
        raise ModelFormatError(f"{what}: int4 group size {group_size} is not one of {GROUP_SIZES}")
    if k % group_size:
        raise ModelFormatError(f"{what}: int4 group size {group_size} does not divide the input dimension {k}")


def quantize(w: torch.Tensor, quant: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, qscale) as stored in a container."""
    return quantize_int8(w) if quant == "int8" else quantize_int4(w, group_size)


def dequantize(qweight: torch.Tensor, qscale: torch.Tensor, quant: str, group_size: int) -> torch.Tensor:
    return dequantize_int8(qweight, qscale) if quant == "int8" else dequantize_int4(qweight, qscale, group_size)


def check_scales(qscale: torch.Tensor, quant: str, shape: tuple[int, int]) -> None:
    """Scales are finite and positive (int4's zeros finite), as quantize writes them.

    A NaN or Inf scale does not crash a kernel: it silently turns a row of weights into NaN and
    changes the tokens (and quality's KL becomes NaN). One pass over the scales, which are
    1/K (int8) or 2/group (int4) of the codes, checked on every read of a quantized matrix.
    """
    if quant == "int4":  # scales_and_zeros [K/group, N, 2]
        scales, zeros = qscale[..., 0], qscale[..., 1]
        ok = bool((scales > 0).all()) and bool(torch.isfinite(scales).all()) and bool(torch.isfinite(zeros).all())
    else:
        ok = bool((qscale > 0).all()) and bool(torch.isfinite(qscale).all())
    if not ok:
        raise ModelFormatError(f"a {quant} [{shape[0]}x{shape[1]}] weight's scales hold NaN, Inf, zero or negative "
                               "values: the container is corrupt (reconvert it)")


def stored_shapes(quant: str, group_size: int, n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (qweight, qscale) for an [N, K] matrix."""
    if quant == "int8":
        return (n, k), (n,)
    return (n, k // 2), (k // group_size, n, 2)


# --- the kernels ----------------------------------------------------------------------------

@lru_cache(maxsize=1)
def stored_int4_is_native() -> bool:
    """Whether this torch build's int4 packing is the stored layout (AVX512 builds): then the
    bytes read from disk are the kernel's operand, zero-copy. Checked by packing a probe."""
    probe = torch.arange(128 * 64, dtype=torch.int32).reshape(128, 64).mul_(7).remainder_(16)
    try:
        native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    except (RuntimeError, NotImplementedError):
        return False
    return native.dtype == torch.uint8 and torch.equal(native.reshape(-1), pack_int4(probe.to(torch.uint8)).reshape(-1))


def _pack_int4_for_kernel(packed: torch.Tensor) -> torch.Tensor:
    if stored_int4_is_native():
        return packed
    # Another CPU's layout: a real repack (tens of ms per expert), paid once per cache miss.
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed).to(torch.int32), 1)


@lru_cache(maxsize=None)
def kernel_works(quant: str, n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether the packed CPU op runs for this shape and activation dtype on this build.

    Tried once on zeros (microseconds): the ops' shape and dtype limits are checked inside
    torch and differ across versions, so asking the op beats copying its rules here.
    """
    try:
        x = torch.zeros(1, k, dtype=dtype)
        if quant == "int8":
            torch.ops.aten._weight_int8pack_mm(x, torch.zeros(n, k, dtype=torch.int8), torch.ones(n, dtype=dtype))
        else:
            packed = _pack_int4_for_kernel(torch.zeros(n, k // 2, dtype=torch.uint8))
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, torch.zeros(k // group_size, n, 2,
                                                                                          dtype=dtype))
        return True
    except (RuntimeError, NotImplementedError):
        return False


class StoredMatrix:
    """What every matrix kept in its stored form shares: int8/int4 (QuantWeight), FP8 block-scaled
    (fp8.Fp8Weight) and MXFP4 (arch/gptoss.Mxfp4Matrix) are codes plus scales multiplied by their
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


@dataclass
class QuantWeight(StoredMatrix):
    """One quantized [N, K] matrix in the form its kernel wants; `linear(x)` = x @ W.T."""

    tensor_fields = ("qweight", "qscale")
    quant: str
    group_size: int
    shape: tuple[int, int]  # (N, K) of the original weight
    kernel: str
    qweight: torch.Tensor  # int8 codes, int4 nibbles, or the kernel's packed int4
    qscale: torch.Tensor  # scales [N] / scales_zeros [K/g, N, 2], in the compute dtype

    @classmethod
    def prepare(cls, qweight: torch.Tensor, qscale: torch.Tensor, quant: str, group_size: int,
                dtype: torch.dtype, packed_kernel: bool = True) -> "QuantWeight":
        n = qweight.shape[0]
        k = qweight.shape[1] * (2 if quant == "int4" else 1)
        check_scales(qscale, quant, (n, k))
        scale = qscale if qscale.dtype == dtype else qscale.to(dtype)
        if packed_kernel and kernel_works(quant, n, k, group_size, dtype):
            if quant == "int4":
                return cls(quant, group_size, (n, k), KERNEL_INT4, _pack_int4_for_kernel(qweight), scale)
            return cls(quant, group_size, (n, k), KERNEL_INT8, qweight, scale)
        return cls(quant, group_size, (n, k), KERNEL_DEQUANT, qweight, scale)

    def native_decode(self, x: torch.Tensor) -> bool:
        """Whether engine/native's int8/int4 kernel takes x @ W.T: one row (decode), on the CPU, in the
        stored layout (int4 repacked for another CPU's torch kernel is not), where VNNI/VBMI exist."""
        return (native.int_ready and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float32)
                and x.device.type == "cpu" and self.qweight.device.type == "cpu"
                and (native.int8_decode if self.quant == "int8" else
                     self.kernel != KERNEL_INT4 or stored_int4_is_native()))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_decode(x):  # decode: integer dot products, ~3x fewer instructions per weight
            if self.quant == "int8":
                return native.int8_linear(x, self.qweight, self.qscale)
            return native.int4_linear(x, self.qweight, self.qscale, self.group_size)
        if self.kernel == KERNEL_INT4:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.qscale)
        if self.kernel == KERNEL_INT8:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.qscale)
        return F.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        if self.kernel == KERNEL_INT4 and not stored_int4_is_native():
            raise ValueError("int4 weights repacked for this CPU's kernel layout cannot be dequantized")
        return dequantize(self.qweight, self.qscale, self.quant, self.group_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.qscale.dtype

    def to(self, device, non_blocking: bool = False) -> "QuantWeight":
        # The VRAM tier moves cached experts; the CPU ops do not run there, so the fallback does.
        if torch.device(device).type == "cpu":
            return self
        if self.kernel == KERNEL_INT4:
            raise ValueError("int4 experts packed for the CPU kernel cannot move to another device")
        return self.moved(device, non_blocking, kernel=KERNEL_DEQUANT)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a plain weight tensor or a QuantWeight (or FP8 Fp8Weight).

    One bf16 row without bias (decode) goes through the native kernel when it is loaded
    (engine/native): the same bits as F.linear in our tests, at about 3x the weight bandwidth
    (a bias stays with F.linear, whose addmm rounds once where adding it after would round twice)."""
    if isinstance(w, torch.Tensor):  # else a stored-quantized matrix: QuantWeight, fp8.Fp8Weight
        if (native.ready and bias is None and x.dim() == 2 and x.shape[0] == 1 and x.dtype is torch.bfloat16
                and w.dtype is torch.bfloat16):
            return native.linear(x, w)
        return F.linear(x, w, bias)
    y = w.linear(x)
    return y if bias is None else y + bias
