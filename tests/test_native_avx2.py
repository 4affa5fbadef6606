"""The native kernels' AVX2 build (engine/native/avx2_compat.h) where the CPU would load the AVX-512 one:
the kernels' own tests run again in a child with COLIBRI_NATIVE_ISA=avx2, so a machine with AVX-512 (CI's,
say) checks the emulation too. On a CPU whose native build is the AVX2 one, the whole suite already runs
it; on one without AVX2, it cannot run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native

TESTS = Path(__file__).resolve().parent
# The bf16 kernels' tests: linear, experts, routers, combine, attention, the whole step, their M-row twins
# (their tolerances against torch's ops and their bit-for-bit row checks), and MXFP4's.
KERNEL_TESTS = ("test_native.py", "test_native_attention.py", "test_native_moe.py", "test_native_rows.py",
                "test_native_step_rows.py", "test_mxfp4_kernel.py")


def test_the_avx2_build_passes_the_kernels_tests_on_a_cpu_that_would_load_the_avx512_one(tmp_path):
    flags = native.cpu_flags()
    if not all(f in flags for f in native.AVX2_FLAGS):
        pytest.skip("this CPU lacks AVX2 and FMA: the AVX2 build cannot run here (this CPU's instruction set)")
    if native.isa_for(flags) == "avx2":
        pytest.skip("this CPU's native build is the AVX2 one: the whole suite runs it")
    if native._compiler() is None:
        pytest.skip("[requires native] no C++ compiler (g++) on PATH")
    # (no COLIBRI_REQUIRE_NATIVE in the child: a kernel test that needs the AVX-512 build skips there; a build
    # that failed to load would skip every test, which the count below refuses)
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_REQUIRE_NATIVE"}
    env["COLIBRI_NATIVE_ISA"] = "avx2"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                           *(str(TESTS / t) for t in KERNEL_TESTS)],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(done.stdout.strip().splitlines()[-15:])
    assert done.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail and " error" not in tail
