"""What a GGUF import writes: HF tensors grouped into items (the units of sharding and progress).

A tensor is made by `load` (whole, float32 or its stored dtype) or, for a tensor too large to
hold at once (gpt_oss's fused per-layer experts), by `chunks`: consecutive slices along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

ELEMENT_BYTES = {"bfloat16": 2, "uint8": 1}


@dataclass
class OutTensor:
    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor] | None  # HF layout; float32 unless dtype says otherwise
    dtype: str = "bfloat16"  # as written: bf16, or uint8 for MXFP4 blocks/scales kept as stored
    chunks: Callable[[], Iterable[torch.Tensor]] | None = None  # instead of load: slices along dim 0
    source: str = ""  # the GGUF tensor it is made from, for error messages

    @property
    def nbytes(self) -> int:
        return ELEMENT_BYTES[self.dtype] * numel(self.shape)


@dataclass
class Item:
    """A unit of writing and of progress: one dense tensor, one routed expert's three, or (gpt_oss)
    one layer's fused experts."""
    label: str
    layer: int  # -1 for the embeddings / final norm / lm_head
    tensors: list[OutTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    config: dict
    items: list[Item]
    skipped: list[str] = field(default_factory=list)  # GGUF tensors deliberately left out, with why


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
