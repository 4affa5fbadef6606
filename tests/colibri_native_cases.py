"""What the fused-decode tests share (tests/test_native_moe.py, test_native_attention.py,
test_native_int.py, test_native_moe_int.py): seeded bf16 operands, the prompt they decode, the tiny
bf16 model they run, a spy that counts calls to one native op while still running it, and the int
kernels' skip mark and int8 switch."""

from __future__ import annotations

import pytest
import torch

from engine import native
from colibri_requirements import needs
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


def needs_native_int():
    """The skip mark of the int8/int4 kernel tests: native ops loaded and VNNI/VBMI present."""
    why = native.load()
    return pytest.mark.skipif(why is not None or not native.int_ready,
                              reason=needs("native", f"native int kernels: {why or 'no VNNI/VBMI'}", int_kernels=True))


@pytest.fixture(autouse=True)
def int8_native_on(monkeypatch):
    """Whatever COLIBRI_NATIVE_INT8 says in this environment, a test module that imports this
    fixture exercises the native int8 kernel."""
    monkeypatch.setattr(native, "int8_decode", True)
