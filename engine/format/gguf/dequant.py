"""ggml tensor types → float32 torch tensors, for the types import supports.

The block math is gguf-py's (`gguf.quants.dequantize`, llama.cpp's own Python port of
ggml-quants.c). It is checked, not trusted: tests/test_gguf_import.py packs blocks from known
codes and scales by the layouts in ggml-common.h and expects exactly those values back, and
benchmarks/formats/gguf_roundtrip.py compares the result bit for bit with llama.cpp's own
dequantization (llama-quantize requantizing the file to F32).

A 3-D tensor (stacked experts) is dequantized one expert at a time (`rows`), so a layer's
experts never sit in memory as float32 all at once.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine.base.errors import ModelFormatError
from engine.format.gguf.reader import GGUFTensor

SUPPORTED = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4)
SUPPORTED_NAMES = ", ".join(t.name for t in SUPPORTED)


def check_type(t: GGUFTensor) -> None:
    if t.ggml_type not in SUPPORTED:
        raise ModelFormatError(f"{t.path}: tensor {t.name!r} has type {t.type_name}, which import does not "
                               f"dequantize (supported: {SUPPORTED_NAMES})")


def dequantize(t: GGUFTensor, index: int | None = None) -> torch.Tensor:
    """float32 values of the tensor in torch order, or of its `index`-th slice along dim 0."""
    check_type(t)
    data = t.data if index is None else t.data[index]
    shape = t.shape if index is None else t.shape[1:]
    if t.ggml_type in (T.F32, T.F16):
        values = np.array(data, dtype=np.float32)  # a copy: the memory map is read-only
    else:
        values = gguf_dequantize(np.ascontiguousarray(data), t.ggml_type)
    out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if tuple(out.shape) != tuple(shape):
        raise ModelFormatError(f"{t.path}: tensor {t.name!r} decodes to shape {tuple(out.shape)}, "
                               f"its header says {tuple(shape)}")
    return out
