"""FP8 block-scaled checkpoints as published (DeepSeek-V3/R1, Kimi-K2, the FP8 releases of GLM and Qwen3).

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[bn, bk], "activation_scheme": "dynamic"}`. Each quantized linear weight `<name>.weight [N, K]` is
stored as F8_E4M3 (1 byte per weight) beside `<name>.weight_scale_inv`, F32 [ceil(N/bn), ceil(K/bk)]:
one scale per block of bn rows x bk inputs, the last blocks of a dimension that bn / bk do not
divide being partial. The scale multiplies (DeepSeek's `weight_dequant`):

    w[n, k] = float(fp8[n, k]) * scale_inv[n // bn, k // bk]

Embeddings, norms, routers and lm_head stay bf16 as published. "dynamic" activations means the
activations are not quantized by the checkpoint: we multiply bf16/fp32 activations with the
stored weights (weight-only, like our int8/int4 containers).

`Fp8Weight` is one such matrix, kept at its stored size: `linear(x)` runs the native e4m3 kernel
(engine/native/fp8_decode.cpp: converts the bytes inside the dot product, no dequantized copy)
for one token, and dequantize-block-wise-then-F.linear for prefill or where native is not loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.base.errors import ModelFormatError
from engine.format.quant import StoredMatrix
from engine.native import fp8 as native_fp8

FP8_TAG = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
SCALE_TAGS = ("F32", "BF16")  # DeepSeek writes F32; accept bf16 scales too (cast to fp32 once)
KERNEL_NATIVE = "colibri.fp8_linear (native e4m3 decode)"
KERNEL_TORCH = "fp8 dequantize+linear"
E4M3_MAX = 448.0
NATIVE_MAX_ROWS = 16  # the kernel re-reads the weights once per row: a GEMM wins beyond a few rows

# Resident FP8 weights kept at 1 byte/weight are the linear projections the model multiplies
# through `quant.linear`. MLA's kv_b_proj is not multiplied as a matrix (its absorbed form views
# it per head, engine/mla.py), and anything else stored FP8 is read as a plain tensor: those are
# dequantized once at load into the compute dtype (and counted so by the plan).
_KEPT = re.compile(r"_proj(_with_mqa)?\.weight$")
_DEQUANTIZED_AT_LOAD = re.compile(r"kv_b_proj\.weight$|\.indexer\.")


@dataclass(frozen=True)
class Fp8Spec:
    block: tuple[int, int]  # (bn rows, bk inputs) per scale

    quant = "fp8"
    scope = "all"  # published FP8 quantizes every linear weight but embeddings, norms, routers

    @property
    def group_size(self) -> int:
        return self.block[1]

    @property
    def label(self) -> str:
        return f"fp8-e4m3-b{self.block[0]}x{self.block[1]}"


def fp8_spec(config: dict, where: str = "config.json") -> Fp8Spec | None:
    """The checkpoint's FP8 spec from `quantization_config`; None when it is not FP8."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelFormatError(f"{where}: quantization_config.fmt {fmt!r} is not supported (FP8 e4m3 only)")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ModelFormatError(f"{where}: quantization_config.activation_scheme {act!r} is not supported "
                               "(dynamic only: static activation scales are not read)")
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelFormatError(f"{where}: quantization_config.weight_block_size {block!r} must be two positive "
                               "integers [rows, inputs] (per-tensor FP8 is not supported)")
    return Fp8Spec((block[0], block[1]))


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def scale_shape(spec: Fp8Spec, n: int, k: int) -> tuple[int, int]:
    return math.ceil(n / spec.block[0]), math.ceil(k / spec.block[1])


def is_fp8(ckpt, name: str) -> bool:
    return name in ckpt and ckpt.info(name).dtype == FP8_TAG


def check_fp8(ckpt, spec: Fp8Spec, name: str, shape: tuple[int, int] | None = None):
    """The (weight, scale_inv) TensorInfos of FP8 matrix `name`, checked: dtype, 2-D, the shape
    config.json implies, scales present with one F32 per block. Each problem is one line."""
    w = ckpt.info(name)
    where = f"{w.path}: {name!r}"
    if w.dtype != FP8_TAG:
        raise ModelFormatError(f"{where} is {w.dtype}, an FP8 checkpoint ({spec.label}) stores it as {FP8_TAG}")
    if len(w.shape) != 2:
        raise ModelFormatError(f"{where} has shape {list(w.shape)}, an FP8 block-scaled matrix is 2-D")
    if shape is not None and tuple(w.shape) != tuple(shape):
        raise ModelFormatError(f"{where} has shape {list(w.shape)}, config.json implies {list(shape)}")
    sname = scale_name(name)
    if sname not in ckpt:
        raise ModelFormatError(f"{where}: missing scales {sname!r} of an FP8 ({spec.label}) checkpoint")
    s = ckpt.info(sname)
    want = scale_shape(spec, *w.shape)
    if s.dtype not in SCALE_TAGS:
        raise ModelFormatError(f"{s.path}: {sname!r} is {s.dtype}, FP8 block scales are F32")
    if tuple(s.shape) != want:
        raise ModelFormatError(
            f"{s.path}: {sname!r} has shape {list(s.shape)}, but [{w.shape[0]}x{w.shape[1]}] in blocks of "
            f"{spec.block[0]}x{spec.block[1]} (quantization_config.weight_block_size) needs {list(want)}")
    return w, s


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


def check_fp8_values(ckpt, spec: "Fp8Spec") -> int:
    """Every FP8 matrix of the checkpoint, every code and every scale (`convert`, `quality`):
    one matrix in memory at a time. Returns how many matrices were checked."""
    names = [n for n, info in ckpt.tensors.items() if info.dtype == FP8_TAG]
    for name in names:
        w, s = check_fp8(ckpt, spec, name)
        check_scale_values(ckpt.load(s.name, torch.float32), f"{s.path}: {s.name!r}")
        check_codes(ckpt.load(name), f"{w.path}: {name!r}", full=True)
    return len(names)


def dense_fp8(ckpt, spec: Fp8Spec | None, names: list[str]) -> tuple[dict, dict]:
    """Of the resident tensors `names`, those stored FP8: (kept at 1 byte/weight, dequantized at
    load), each name → its checked (weight, scale_inv) infos."""
    kept, dequantized = {}, {}
    if spec is None:
        return kept, dequantized
    for name in names:
        if not is_fp8(ckpt, name):
            continue
        infos = check_fp8(ckpt, spec, name)
        if _KEPT.search(name) and not _DEQUANTIZED_AT_LOAD.search(name):
            kept[name] = infos
        else:
            dequantized[name] = infos
    return kept, dequantized


def dense_nbytes(infos, dtype_bytes: int) -> int:
    """RAM of a kept FP8 matrix: its bytes as stored plus its scales in fp32."""
    w, s = infos
    return w.nbytes + math.prod(s.shape) * 4


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
        return KERNEL_NATIVE if native_fp8.ready and self.weight.device.type == "cpu" else KERNEL_TORCH

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        # Up to NATIVE_MAX_ROWS rows (decode, short prompts) the native kernel: no dequantized copy,
        # whose fp32 temporaries the allocator keeps (measured: +175 MiB RSS over a 4-token prefill
        # of the 8-layer demo, past a 1 GiB budget). Longer prefills: dequantize, then one GEMM.
        if (native_fp8.ready and x.dim() == 2 and x.shape[0] <= NATIVE_MAX_ROWS
                and x.dtype in (torch.bfloat16, torch.float32)
                and self.weight.device.type == "cpu"):
            return native_fp8.linear(x, self.weight, self.scale, self.block)
        return F.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def to(self, device, non_blocking: bool = False) -> "Fp8Weight":
        # The VRAM tier moves cached experts; there the torch fallback computes them.
        return self if torch.device(device).type == "cpu" else self.moved(device, non_blocking)


def load_dense(infos, spec: Fp8Spec, read_tensor) -> Fp8Weight:
    w, s = infos
    return Fp8Weight.from_stored(read_tensor(w), read_tensor(s), spec.block, f"{s.path}: {s.name!r}",
                                 f"{w.path}: {w.name!r}")


def load_dequantized(infos, spec: Fp8Spec, read_tensor, dtype: torch.dtype, full: bool = False) -> torch.Tensor:
    """One FP8 matrix as `dtype` values; `full`: every code checked (convert), else a sample."""
    w, s = infos
    scale = read_tensor(s).float()
    check_scale_values(scale, f"{s.path}: {s.name!r}")
    codes = read_tensor(w)
    check_codes(codes, f"{w.path}: {w.name!r}", full=full)
    return dequantize(codes, scale, spec.block).to(dtype)
