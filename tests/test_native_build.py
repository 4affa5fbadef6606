"""The native kernels' sources compile on any x86-64 machine with g++, in each build (AVX-512, and AVX2 over
engine/native/avx2_compat.h), even one whose CPU could not run that build: there the suite's native tests
take the build it can run, or skip as hardware (tests/colibri_requirements.py), and this is what keeps a
broken kernel source from passing CI on such a machine."""

import pytest

from engine import native


@pytest.mark.parametrize("isa", native.ISAS)
def test_the_native_sources_compile_where_the_cpu_cannot_run_them(isa, tmp_path):
    if isa in native.runnable_isas(native.cpu_flags()):
        pytest.skip(f"this CPU runs the {isa} build: loading it builds it (tests/test_native.py)")
    if native._compiler() is None:
        pytest.skip("[requires native] no C++ compiler (g++) on PATH")
    out = tmp_path / "colibri_native.so"
    native.build(out, optimize=False, isa=isa)  # (-O0: the sources and the link checked, ~100 s here; -O3 ~135)
    assert out.stat().st_size > 1_000_000  # a library, every source of the build in it (2.7 MB at -O0)


def test_one_avx2_library_whatever_else_the_cpu_has(tmp_path, monkeypatch):
    """The kernel cache keys a build by the flags it compiles for: the AVX2 build of a CPU without
    AVX512-BF16 and the one COLIBRI_NATIVE_ISA=avx2 asks for on an AVX-512 CPU are one library (built
    once: CI's two AVX2 tests built it twice); the AVX-512 build's key still follows its own flags."""
    monkeypatch.setenv("COLIBRI_KERNEL_CACHE", str(tmp_path))
    wide = {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
    narrow = wide - {"avx512_bf16", "avx512_vnni", "avx512bw", "avx512f"}
    assert native._library_path("g++", wide, "avx2") == native._library_path("g++", narrow, "avx2")
    assert native._library_path("g++", wide, "avx2") != native._library_path("g++", wide - {"fma"}, "avx2")
    assert native._library_path("g++", wide, "avx512") != native._library_path("g++", wide, "avx2")
    assert native._library_path("g++", wide, "avx512") != native._library_path("g++", wide - {"avx512_bf16"}, "avx512")
    assert native._library_path("g++", wide, "avx2").parent == tmp_path
