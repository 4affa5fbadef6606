"""FP8 block-scaled checkpoints as published (DeepSeek-V3/R1, Kimi-K2, the FP8 releases of GLM and Qwen3):
what config.json and the safetensors say, and reading their FP8 matrices into engine/weights/fp8.py's
Fp8Weight (the math is there).

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[bn, bk], "activation_scheme": "dynamic"}`. Each quantized linear weight `<name>.weight [N, K]` is
stored as F8_E4M3 (1 byte per weight) beside `<name>.weight_scale_inv`, F32 [ceil(N/bn), ceil(K/bk)]:
one scale per block of bn rows x bk inputs.

Embeddings, norms, routers and lm_head stay bf16 as published.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from engine.base.errors import ModelFormatError
from engine.weights.fp8 import Fp8Weight, check_codes, check_scale_values, dequantize

FP8_TAG = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
SCALE_TAGS = ("F32", "BF16")  # DeepSeek writes F32; accept bf16 scales too (cast to fp32 once)

# Resident FP8 weights kept at 1 byte/weight are the linear projections the model multiplies
# through `engine.weights.stored.linear`. MLA's kv_b_proj is not multiplied as a matrix (its absorbed form views
# it per head, engine/arch/mla.py), and anything else stored FP8 is read as a plain tensor: those are
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
