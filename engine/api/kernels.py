"""Kernel facts for the probe and `colibri doctor`: whether the native decode kernels load here."""

from __future__ import annotations

from engine import native


def load_native_kernels(again: bool = False) -> str | None:
    """Build or load the native kernels: None when they loaded, else why not (engine/native)."""
    return native.load(again)


def native_kernels_ready() -> bool:
    """Whether the native bf16 kernels are loaded (read now: a load since changes it)."""
    return bool(native.ready)


def native_kernels_build() -> str | None:
    """Which build of the native kernels is loaded: "avx512", "avx2" (engine/native/avx2_compat.h), or None."""
    return native.isa if native.ready else None


def runnable_native_builds() -> list[str]:
    """The builds of the native kernels this CPU runs: "avx512" (AVX512-BF16), "avx2" (AVX2 and FMA: also on
    an AVX-512 CPU, where COLIBRI_NATIVE_ISA=avx2 selects it)."""
    return native.runnable_isas(native.cpu_flags())
