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

import torch
import torch.nn.functional as F

from engine import native
from engine.base.errors import ModelFormatError
from engine.weights.stored import StoredMatrix

QUANTS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPE = torch.bfloat16  # stored dtype of scales and zeros
INT4_MID = 8  # the kernel subtracts 8 from every code

KERNEL_INT8 = "aten._weight_int8pack_mm"
KERNEL_INT4 = "aten._weight_int4pack_mm_for_cpu"
KERNEL_INT4_STRIPS = "colibri int4 strips (VNNI)"
KERNEL_INT4_STRIPS_REFERENCE = "int4 strips, float64 reference"
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


# The engine's own int4 layout, in memory only: what engine/native's int4 kernel reads (its header,
# int_kernels.h, says why). Rows in strips of 16; a strip is K/g groups, each g/8 chunks of 64 code
# bytes (chunk c covers inputs k0 .. k0+7 of the group, k0 = 8c: byte 4r + j = row r's code of k0 + j
# in the low nibble, of k0 + 4 + j in the high one) then the 16 rows' (scale, zero) bf16 pairs. Rows
# past the last full strip follow one by one: K/2 bytes (low nibble = even k), then their K/g pairs.
# The same bytes as the stored pair (N * K/2 + 4 * N * K/g), so a matrix is repacked in place as
# it is read (native.int4_strips); these two functions are the reference the tests hold it to.
INT4_STRIP = 16


def strip_row_bytes(k: int, group_size: int) -> int:
    return k // 2 + 4 * (k // group_size)


def pack_int4_strips(codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes 0..15 uint8 [N, K], scales_zeros bf16 [K/g, N, 2] → uint8 [N, K/2 + 4K/g] strips."""
    N, K = codes.shape
    G, full = K // group_size, N - N % INT4_STRIP
    pairs = scales_zeros.to(SCALE_DTYPE).contiguous().view(torch.uint8).reshape(G, N, 4)
    parts = []
    if full:
        S = full // INT4_STRIP
        c = codes[:full].reshape(S, INT4_STRIP, K // 8, 2, 4)  # [strip, row, chunk, low/high, j]
        chunks = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # [S, K/8, 16, 4]
        chunks = chunks.reshape(S, G, group_size // 8 * 64)
        sz = pairs[:, :full].reshape(G, S, INT4_STRIP * 4).transpose(0, 1)  # [S, G, 64]
        parts.append(torch.cat([chunks, sz], dim=2).reshape(-1))
    if full < N:
        r = codes[full:].reshape(N - full, K // 2, 2)
        parts.append(torch.cat([r[..., 0] | (r[..., 1] << 4), pairs[:, full:].transpose(0, 1).reshape(N - full, 4 * G)],
                               dim=1).reshape(-1))
    return torch.cat(parts).reshape(N, strip_row_bytes(K, group_size))


def unpack_int4_strips(strips: torch.Tensor, k: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, K/2 + 4K/g] strips → (codes 0..15 uint8 [N, K], scales_zeros bf16 [K/g, N, 2])."""
    N, K, G = strips.shape[0], k, k // group_size
    flat = strips.reshape(-1)
    full = N - N % INT4_STRIP
    codes, pairs = [], []
    if full:
        S = full // INT4_STRIP
        b = flat[: full * strip_row_bytes(K, group_size)].reshape(S, G, group_size // 8 * 64 + 64)
        c = b[:, :, :-64].reshape(S, K // 8, INT4_STRIP, 4).permute(0, 2, 1, 3)  # [S, 16, K/8, 4]
        codes.append(torch.stack([c & 0xF, c >> 4], dim=3).reshape(full, K))
        pairs.append(b[:, :, -64:].transpose(0, 1).reshape(G, full, 4))
    if full < N:
        r = flat[full * strip_row_bytes(K, group_size):].reshape(N - full, strip_row_bytes(K, group_size))
        codes.append(torch.stack([r[:, : K // 2] & 0xF, r[:, : K // 2] >> 4], dim=2).reshape(N - full, K))
        pairs.append(r[:, K // 2:].reshape(N - full, G, 4).transpose(0, 1))
    sz = torch.cat(pairs, dim=1).contiguous().view(SCALE_DTYPE).reshape(G, N, 2)
    return torch.cat(codes), sz


def strips_reference_linear(x: torch.Tensor, strips: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """What engine/native's strip kernel computes for x @ W.T, in torch ops: x quantized to int8 per
    32 inputs in fp32 as the kernel does, exact integer dot products, the rest in float64 (the
    kernel's fp32 sums differ by ~1e-7 of the scale). The oracle that engine-level tests swap in
    for the kernel, where a dequantized matrix would differ by the activations' rounding."""
    codes, sz = unpack_int4_strips(strips, k, group_size)
    M, B, G = x.shape[0], k // 32, k // group_size
    xf = x.float().reshape(M, B, 32)
    amax = xf.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int64)  # [M, B, 32]
    c = codes.to(torch.int64).reshape(-1, B, 32)  # [N, B, 32]
    dots = torch.einsum("mbi,nbi->mnb", q, c) - 8 * q.sum(dim=2)[:, None, :]  # [M, N, B] exact
    f = (dots.double() * (amax / 127.0).double().reshape(M, 1, B)).reshape(M, -1, G, group_size // 32).sum(dim=3)
    scale, zero = sz.double().transpose(0, 1).unbind(dim=2)  # [N, G] each
    xsum = x.double().reshape(M, G, group_size).sum(dim=2)  # [M, G]
    return ((f * scale[None]).sum(dim=2) + xsum @ zero.T).to(x.dtype)


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
        raise ModelFormatError(bad_scales_message(quant, shape))


def bad_scales_message(quant: str, shape: tuple[int, int]) -> str:
    return (f"a {quant} [{shape[0]}x{shape[1]}] weight's scales hold NaN, Inf, zero or negative values: the container "
            "is corrupt (reconvert it)")


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


def int4_strips_on() -> bool:
    """Whether int4 matrices are repacked into engine/native's strips as they are read: its library
    loads on a VNNI/VBMI CPU. Then they hold their bytes as stored (bf16 scales inside), whatever
    the compute dtype: what the memory plan charges."""
    return native.load() is None and native.int_ready


def strips_apply(qweight: torch.Tensor, qscale: torch.Tensor) -> bool:
    """Whether this int4 pair goes to the strips: they are on, and it is as stored (CPU,
    contiguous, bf16 scales)."""
    return (int4_strips_on() and qweight.device.type == "cpu" and qweight.dtype == torch.uint8
            and qweight.is_contiguous() and qscale.dtype == SCALE_DTYPE and qscale.is_contiguous())


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


@dataclass
class QuantWeight(StoredMatrix):
    """One quantized [N, K] matrix in the form its kernel wants; `linear(x)` = x @ W.T."""

    tensor_fields = ("qweight", "qscale")
    quant: str
    group_size: int
    shape: tuple[int, int]  # (N, K) of the original weight
    kernel: str
    qweight: torch.Tensor  # int8 codes, int4 nibbles, torch's packed int4, or int4 strips (scales inside)
    qscale: torch.Tensor  # scales [N] / scales_zeros [K/g, N, 2] in the compute dtype; strips: empty, that dtype

    @classmethod
    def prepare(cls, qweight: torch.Tensor, qscale: torch.Tensor, quant: str, group_size: int,
                dtype: torch.dtype, packed_kernel: bool = True, joined: torch.Tensor | None = None) -> "QuantWeight":
        """joined: uint8 over the pair's own bytes where the scales follow the codes in one writable
        buffer (a slot, the arena): int4 strips are written there, in place, so a cached expert is
        still its slot; without it they take new memory."""
        n = qweight.shape[0]
        k = qweight.shape[1] * (2 if quant == "int4" else 1)
        if quant == "int4" and packed_kernel and strips_apply(qweight, qscale):
            rows = strip_row_bytes(k, group_size)
            out = (joined.view(n, rows) if joined is not None and joined.numel() == n * rows
                   else torch.empty(n, rows, dtype=torch.uint8))
            if not native.int4_strips(qweight, qscale, group_size, out):  # check_scales' test, in the copy
                raise ModelFormatError(bad_scales_message(quant, (n, k)))
            return cls(quant, group_size, (n, k), KERNEL_INT4_STRIPS, out, torch.empty(0, dtype=dtype))
        check_scales(qscale, quant, (n, k))
        scale = qscale if qscale.dtype == dtype else qscale.to(dtype)
        if packed_kernel and kernel_works(quant, n, k, group_size, dtype):
            if quant == "int4":
                return cls(quant, group_size, (n, k), KERNEL_INT4, _pack_int4_for_kernel(qweight), scale)
            return cls(quant, group_size, (n, k), KERNEL_INT8, qweight, scale)
        return cls(quant, group_size, (n, k), KERNEL_DEQUANT, qweight, scale)

    def native_decode(self, x: torch.Tensor) -> bool:
        """Whether engine/native's int8/int4 kernel takes x @ W.T for one row (decode) on the CPU:
        int8 where VNNI exists (and COLIBRI_NATIVE_INT8 allows), int4 when it is in strips."""
        return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
                and (self.kernel == KERNEL_INT4_STRIPS if self.quant == "int4" else
                     native.int_ready and native.int8_decode and self.qweight.device.type == "cpu"))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == KERNEL_INT4_STRIPS:  # every row count: strips have no other kernel
            return native.int4_linear(x, self.qweight, self.group_size)
        if self.kernel == KERNEL_INT4_STRIPS_REFERENCE:
            return strips_reference_linear(x, self.qweight, self.shape[1], self.group_size)
        if self.native_decode(x):  # decode: integer dot products, ~3x fewer instructions per weight
            return native.int8_linear(x, self.qweight, self.qscale)
        if self.kernel == KERNEL_INT4:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.qscale)
        if self.kernel == KERNEL_INT8:
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.qscale)
        return F.linear(x, self.dequantize().to(x.dtype))

    def reference(self):
        """A stand-in that computes what this matrix's kernel does, in plain torch (tests): the
        dequantized tensor, or for int4 strips their float64 reference (strips_reference_linear)."""
        if self.kernel == KERNEL_INT4_STRIPS:
            return dataclasses.replace(self, kernel=KERNEL_INT4_STRIPS_REFERENCE)
        return self.dequantize()

    def dequantize(self) -> torch.Tensor:
        if self.kernel in (KERNEL_INT4_STRIPS, KERNEL_INT4_STRIPS_REFERENCE):
            codes, sz = unpack_int4_strips(self.qweight, self.shape[1], self.group_size)
            return dequantize_int4(pack_int4(codes), sz, self.group_size)
        if self.kernel == KERNEL_INT4 and not stored_int4_is_native():
            # Repacked for this CPU's kernel (no AVX-512: torch's layout is its own): the kernel itself over
            # the identity gives each weight exactly (one product by 1.0 and zeros, in fp32). [K, K] fp32:
            # a test's or a converter's cost, never decode's (linear calls the kernel).
            K = self.shape[1]
            eye = torch.eye(K, dtype=torch.float32, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.qscale.float()).t()
        return dequantize(self.qweight, self.qscale, self.quant, self.group_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.qscale.dtype

    @property
    def strips(self) -> bool:
        return self.kernel == KERNEL_INT4_STRIPS

    def to(self, device, non_blocking: bool = False) -> "QuantWeight":
        # The VRAM tier moves cached experts; the CPU ops do not run there, so the fallback does.
        if torch.device(device).type == "cpu":
            return self
        if self.kernel in (KERNEL_INT4, KERNEL_INT4_STRIPS):
            raise ValueError("int4 experts packed for the CPU kernel cannot move to another device")
        return self.moved(device, non_blocking, kernel=KERNEL_DEQUANT)
