"""Optional dependencies of the suite, and the switch that makes them required.

A test that cannot run without fio, PostgreSQL, a memory cgroup, io_uring, the native kernels,
Chromium or llama.cpp's source tree (its GGUF converter) skips with a reason made by
`needs(dep, why)`. Where the environment sets `COLIBRI_REQUIRE_<DEP>=1` (CI sets every one,
.ci/run), tests/conftest.py turns such a skip into a failure, so a green CI cannot hide a
dependency that setup.sh failed to install.
"""

import os

DEPENDENCIES = ("fio", "postgres", "cgroup", "uring", "native", "chromium", "llama_cpp")


def needs(dep: str, why: str, int_kernels: bool = False) -> str:
    """The skip reason for a test that needs `dep`: tagged so the require switch can find it. Not
    tagged where the dependency is the CPU itself: the native kernels on a CPU with neither AVX-512
    (AVX512-BF16) nor AVX2 and FMA (their AVX2 build), and the int8/int4 ones (int_kernels) on a CPU
    without AVX-512 VNNI and VBMI, skip on any machine like it, CI's included (the sources are still
    compiled there: tests/test_native_build.py)."""
    assert dep in DEPENDENCIES, dep
    if dep == "native" and cpu_lacks_native(int_kernels):
        return f"{why} (this CPU's instruction set: runs where the CPU has it)"
    return f"[requires {dep}] {why}"


def cpu_lacks_native(int_kernels: bool = False) -> list[str]:
    """The instruction sets the native kernels need that this CPU does not have."""
    from engine import native
    flags = native.cpu_flags()
    if not int_kernels and native.isa_for(flags) is not None:
        return []
    wanted = native.REQUIRED_FLAGS + (native.INT_FLAGS if int_kernels else ())
    lacking = [f for f in wanted if f not in flags]
    if int_kernels and not lacking and native.isa_for(flags) != "avx512":  # COLIBRI_NATIVE_ISA=avx2 here
        return ["the AVX-512 build (COLIBRI_NATIVE_ISA=avx2 asks for the AVX2 one, which has no int kernels)"]
    return lacking


def required(dep: str) -> bool:
    return os.environ.get(f"COLIBRI_REQUIRE_{dep.upper()}", "") not in ("", "0")


def required_dependency_in(reason: str) -> str | None:
    """The dependency a skip reason names when that dependency is required here, else None."""
    for dep in DEPENDENCIES:
        if f"[requires {dep}]" in reason and required(dep):
            return dep
    return None
