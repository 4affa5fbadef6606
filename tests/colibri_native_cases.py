"""What the fused-decode tests share (tests/test_native_moe.py, test_native_attention.py): seeded
bf16 operands, the prompt they decode, the tiny bf16 model they run, and a spy that counts
calls to one native op while still running it."""

from __future__ import annotations

import pytest
import torch

from engine import native
from colibri_tiny import make_tiny

PROMPT = [3, 17, 42, 5, 99, 7]


def rand_bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A 3-layer bf16 tiny model (the fused ops are bf16-only); a module that imports this fixture
    gets its own copy."""
    return make_tiny(tmp_path_factory.mktemp("bf16") / "m", dtype="bfloat16", num_hidden_layers=3)


def count_calls(monkeypatch, name: str) -> list:
    """Counts every call of native.<name> (one list entry each); the op itself still runs."""
    calls, real = [], getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a: calls.append(1) or real(*a))
    return calls
