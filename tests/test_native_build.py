"""The native kernels' sources compile on any x86-64 machine with g++, even one whose CPU could not run
them (no AVX-512): there the suite's native tests skip as hardware (tests/colibri_requirements.py), and
this is what keeps a broken kernel source from passing CI on such a machine."""

import pytest

from colibri_requirements import cpu_lacks_native
from engine import native


def test_the_native_sources_compile_where_the_cpu_cannot_run_them(tmp_path):
    if not cpu_lacks_native():
        pytest.skip("this CPU runs the kernels: loading them builds them (tests/test_native.py)")
    if native._compiler() is None:
        pytest.skip("[requires native] no C++ compiler (g++) on PATH")
    out = tmp_path / "colibri_native.so"
    native.build(out, optimize=False)  # (-O0: the sources and the link checked, ~100 s here; -O3 takes ~135)
    assert out.stat().st_size > 1_000_000  # a library, every source in it (2.7 MB at -O0)
