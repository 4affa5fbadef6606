"""The memory plan's prefill charge is honest: it holds what a layer-major prefill really allocates.

Two halves, each counted, never timed:
- tensors: torch's profiler counts every CPU allocation made during a prefill (its running total
  of live bytes); the peak must stay within the plan's counted bytes (prefill_group_bytes for the
  group, prefill_transient_bytes for one sub-chunk, before the allocator factor), for every
  architecture, a quantized KV cache too, at a group long enough that its state dominates;
- what is not a tensor: the native matmul caches (oneDNN's, and ideep's above it) grow with every
  new row count; engine/base/heap.py caps both, and glibc's count of allocated bytes must stay within
  NATIVE_CACHE_BYTES over hundreds of row counts (uncapped, ideep's kept ~0.5 MiB per shape: what
  OOM-killed 1,024- and 2,048-token groups on demo under a 1 GiB cgroup).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engine.base.config import EngineConfig
from engine.base.heap import IDEEP_CACHE_ENV, NATIVE_CACHE_BYTES, PRIMITIVE_CACHE_ENV
from engine.movement.plan import prefill_group_bytes, prefill_transient_bytes
from engine.run.runtime import Engine
from colibri_hf_models import ARCHS, built_once

ROOT = Path(__file__).resolve().parent.parent
# (tokens, sub-chunk, ctx): a short prompt of a few sub-chunks, and a long group whose state (the
# residual, the routed sum, the routing) is most of the peak, so a group state charged short by a
# tensor of [T, H] shows.
SHAPES = [(40, 8, 64), (512, 16, 512)]
CASES = [(arch, "auto") for arch in sorted(ARCHS)] + [("qwen3_moe", "int8"), ("deepseek_v3", "int8")]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return built_once(tmp_path_factory, "charge")


def _live_peak(fn, trace: Path) -> int:
    """The most bytes of CPU tensors allocated inside fn() alive at once (torch's profiler keeps the
    running total of what it saw allocated and not yet freed)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]"]
    assert totals, "the profiler reported no allocation: nothing was measured"
    return max(totals)


@pytest.mark.parametrize("arch,kv", CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_the_counted_charge_holds_every_tensor_a_prefill_allocates(hf_dirs, tmp_path, arch, kv):
    """peak live tensor bytes of Transformer.prefill (a whole group, attention in sub-chunks) <= the
    group's state + one sub-chunk's transients + the fp32 logits, as the plan counts them."""
    torch.set_num_threads(1)  # one thread allocates: the profiler's total is the process's
    for tokens, sub, ctx in SHAPES:
        with Engine(hf_dirs(arch), EngineConfig(ctx_size=ctx, dtype="fp32", threads=1, kv_dtype=kv)) as engine:
            ids = torch.tensor([(7 * i + 3) % 256 for i in range(tokens)])
            engine.model.prefill(ids[:sub], 0, engine.kv, sub)  # lazily built tables are not the prefill's
            peak = _live_peak(lambda: engine.model.prefill(ids, 0, engine.kv, sub), tmp_path / "trace.json")
            a = engine.args
            # The plan's group state: without a budget the norm is held (plan.prefill_norm_held)
            counted = (prefill_group_bytes(a, tokens, torch.float32, ctx, engine.plan.prefill_norm_held)
                       + prefill_transient_bytes(a, sub, torch.float32, ctx, engine.kv_dtype) + 4 * a.vocab_size)
        assert peak <= counted, (f"{arch} kv {kv}, {tokens} tokens in sub-chunks of {sub}: {peak} bytes "
                                 f"live at once, the plan counts {counted}")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_a_group_that_does_not_hold_the_norm_allocates_within_the_smaller_charge(hf_dirs, tmp_path, arch):
    """Where the budget leaves no room for the norm (plan.prefill_norm_held False) the group norms
    its rows per use, and its peak stays within the charge without the norm."""
    torch.set_num_threads(1)
    tokens, sub, ctx = SHAPES[-1]
    with Engine(hf_dirs(arch), EngineConfig(ctx_size=ctx, dtype="fp32", threads=1)) as engine:
        assert engine.plan.prefill_norm_held  # no budget: held, so this test sets the other state
        engine.model.prefill_norm_held = False
        ids = torch.tensor([(7 * i + 3) % 256 for i in range(tokens)])
        engine.model.prefill(ids[:sub], 0, engine.kv, sub)
        peak = _live_peak(lambda: engine.model.prefill(ids, 0, engine.kv, sub), tmp_path / "trace.json")
        a = engine.args
        counted = (prefill_group_bytes(a, tokens, torch.float32, ctx, False)
                   + prefill_transient_bytes(a, sub, torch.float32, ctx, engine.kv_dtype) + 4 * a.vocab_size)
        held = prefill_group_bytes(a, tokens, torch.float32, ctx, True)
    assert peak <= counted, f"{arch}: {peak} bytes live at once, the plan counts {counted} without the norm"
    assert held - prefill_group_bytes(a, tokens, torch.float32, ctx, False) == tokens * a.hidden_size * 4


_NATIVE_GROWTH = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from engine.base import heap  # noqa: F401  (what the engine imports first: the caps)
import torch
import torch.nn.functional as F

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def allocated():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

torch.set_num_threads(1)
w = torch.randn(256, 256).bfloat16()
F.linear(torch.randn(3, 256).bfloat16(), w)
before = allocated()
for rows in range(4, 304):  # 300 row counts: an expert's rows in a long prompt's group
    F.linear(torch.randn(rows, 256).bfloat16(), w)
print(allocated() - before)
"""


def _native_growth(env: dict) -> int:
    out = subprocess.run([sys.executable, "-c", _NATIVE_GROWTH, str(ROOT)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def _onednn_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc's mallinfo2 counts the native caches' bytes")
@pytest.mark.skipif(not _onednn_bf16(), reason="this CPU's bf16 matmuls do not go through oneDNN (it has no "
                                                "AVX-512): no primitive caches to cap")
def test_the_native_matmul_caches_stay_within_their_charge():
    """engine/base/heap.py caps oneDNN's and ideep's caches unless the user set them: 300 distinct
    row counts of a bf16 matmul leave at most NATIVE_CACHE_BYTES allocated; with ideep's default
    capacity (1024) they leave more, so this measures what the cap bounds."""
    env = {k: v for k, v in os.environ.items() if k not in (PRIMITIVE_CACHE_ENV, IDEEP_CACHE_ENV)}
    capped = _native_growth(env)
    assert capped <= NATIVE_CACHE_BYTES, f"{capped} bytes kept by the native caches, charged {NATIVE_CACHE_BYTES}"
    uncapped = _native_growth({**env, IDEEP_CACHE_ENV: "1024", PRIMITIVE_CACHE_ENV: "1024"})
    assert uncapped > NATIVE_CACHE_BYTES, f"uncapped, the caches kept only {uncapped} bytes: the check measures nothing"
