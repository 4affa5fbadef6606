"""Kernel facts for the probe and `colibri doctor`: whether the native decode kernels load here."""

from __future__ import annotations

from engine import native


def load_native_kernels(again: bool = False) -> str | None:
    """Build or load the native kernels: None when they loaded, else why not (engine/native)."""
    return native.load(again)


def native_kernels_ready() -> bool:
    """Whether the native bf16 kernels are loaded (read now: a load since changes it)."""
    return bool(native.ready)
