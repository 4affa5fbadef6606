"""The native int8/int4 decode kernels (engine/native/int_decode.cpp): right products on odd shapes
and edge groups, the same bits batched or per expert, and torch's kernels as the fallback when
native is disabled, when the CPU lacks VNNI/VBMI, when there is no compiler, or when a build
failed before (remembered, not retried)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import native
from engine.arch.layers import native_quant_operands, swiglu_expert
from engine.weights.quantized import (KERNEL_INT4_STRIPS, QuantWeight, dequantize, pack_int4_strips, quantize,
                                 strip_row_bytes, unpack_int4, unpack_int4_strips)
from colibri_native_cases import int8_native_on, needs_native_int  # noqa: F401 (int8_native_on: a fixture)

pytestmark = needs_native_int()


# (N, K, group): full 64-row blocks, a partial last block (N % 64 = 2, 6, 50), ragged int8 K
# (not a multiple of 32), one group per row and many.
SHAPES = [(64, 64, 32), (130, 96, 32), (70, 256, 128), (2, 64, 64), (198, 192, 64), (512, 1024, 64)]


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    """Within `rel` of the reference's scale (int16 activations: ~1e-4 of max|x|·|w| per sum)."""
    return float((y.float() - ref).abs().max()) <= rel * float(ref.abs().max())


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_dequantized_reference(quant, n, k, group, dtype):
    g = torch.Generator().manual_seed(n * k + group)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(2, k, generator=g)  # two rows: the op loops over M
    if quant == "int8" and k % 32 == 0:
        w, x = w[:, : k - 5], x[:, : k - 5]  # a ragged K: the masked tail
    qw, qs = quantize(w, quant, group)
    ref = x @ dequantize(qw, qs, quant, group).T
    xs = x.to(dtype)
    if quant == "int8":
        y = native.int8_linear(xs, qw, qs.to(dtype))
        # fp32: only the int16 activations' error; bf16: plus one rounding of x and of y
        assert _close(y, ref, 2e-4 if dtype == torch.float32 else 1.5e-2)
    else:
        strips = torch.empty(n, strip_row_bytes(k, group), dtype=torch.uint8)
        native.int4_strips(qw, qs, group, strips)
        y = native.int4_linear(xs, strips, group)
        # int8 activations per 32 inputs (Q8_0's): <= max|x_b| / 254 an element, ~5e-3 of the largest output
        assert _close(y, ref, 1.2e-2 if dtype == torch.float32 else 2e-2)
    assert y.shape == ref.shape and y.dtype == dtype


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_int4_strips_repack_matches_the_reference_and_round_trips(n, k, group):
    """native.int4_strips (the stored layout → strips, AVX-512 byte permutes over full 64-row blocks,
    a scalar path for the rest) writes pack_int4_strips' bytes, which unpack to the stored codes and
    scales exactly; and it repacks in place over the pair's own bytes (what a slot read does)."""
    g = torch.Generator().manual_seed(n + k + group)
    qw, qs = quantize(torch.randn(n, k, generator=g), "int4", group)
    ref = pack_int4_strips(unpack_int4(qw), qs, group)
    out = torch.empty_like(ref)
    native.int4_strips(qw, qs, group, out)
    assert torch.equal(out, ref)
    codes, sz = unpack_int4_strips(ref, k, group)
    assert torch.equal(codes, unpack_int4(qw)) and torch.equal(sz, qs)
    joined = torch.cat([qw.reshape(-1), qs.view(torch.uint8).reshape(-1)])
    weight = QuantWeight.prepare(joined[:qw.numel()].view(qw.shape), joined[qw.numel():].view(torch.bfloat16).view(qs.shape),
                                 "int4", group, torch.bfloat16, joined=joined)
    assert weight.kernel == KERNEL_INT4_STRIPS and weight.qweight.data_ptr() == joined.data_ptr()
    assert torch.equal(joined.view(ref.shape), ref)
    assert torch.equal(weight.dequantize(), dequantize(qw, qs, "int4", group))


def test_int4_strips_give_every_row_the_same_bits_in_a_strip_or_past_them():
    """The tail rows' scalar loop sums in the strips' order: a row's output is the same whether the
    matrix has 18 rows (row 16 in the tail) or 32 (row 16 in the second strip)."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 128, generator=g), torch.randn(1, 128, generator=g)
    y = {}
    for n in (18, 32):
        qw, qs = quantize(w[:n], "int4", 32)
        y[n] = QuantWeight.prepare(qw, qs, "int4", 32, torch.float32).linear(x)
    assert torch.equal(y[18], y[32][:, :18])


def _experts(quant: str, group: int, n: int, hidden: int = 128, inter: int = 96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        mats = [torch.randn(inter, hidden, generator=g) * 0.2, torch.randn(inter, hidden, generator=g) * 0.2,
                torch.randn(hidden, inter, generator=g) * 0.2]
        out.append(tuple(QuantWeight.prepare(*quantize(m, quant, group), quant, group, dtype) for m in mats))
    return out


# int4 g32 with I = 160: the gate/up rows end in a partial 32-row block
@pytest.mark.parametrize("quant,group,inter", [("int8", 0, 96), ("int4", 32, 160), ("int4", 64, 192)])
def test_experts_batched_equal_alone_and_match_swiglu(quant, group, inter):
    experts = _experts(quant, group, 5, inter=inter)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    operands, g = native_quant_operands(x, experts)
    batched = native.quant_experts(x, operands, g)
    assert batched.shape == (5, 128)
    for j, ws in enumerate(experts):
        alone = swiglu_expert(x, ws)  # the per-expert (streaming) path
        assert torch.equal(alone[0], batched[j])
        gate, up, down = (w.dequantize().float() for w in ws)
        h = torch.nn.functional.silu((x.float() @ gate.T).bfloat16()) * (x.float() @ up.T).bfloat16()
        assert _close(batched[j:j + 1], h.float() @ down.T, 2e-2)


def test_prefill_and_mixed_experts_keep_torchs_kernels():
    ws = _experts("int8", 0, 1)[0]
    x = torch.randn(3, 128).bfloat16()
    assert not ws[0].native_decode(x)  # several rows: torch's packed kernel
    mixed = [ws, _experts("int4", 32, 1)[0]]
    assert native_quant_operands(x[:1], mixed) is None


@pytest.fixture
def fresh_native(monkeypatch):
    """native.load() re-run in a changed environment, then the real state restored."""
    yield monkeypatch
    monkeypatch.undo()
    native.load(again=True)
    assert native.ready and native.int_ready


def _fallback_matches_torch(ws, x):
    """The decode product goes through torch's own kernel: equal to calling it directly."""
    direct = torch.ops.aten._weight_int8pack_mm(x, ws.qweight, ws.qscale)
    assert not ws.native_decode(x)
    assert torch.equal(ws.linear(x), direct)


def test_disabled_native_falls_back_to_torch(fresh_native):
    fresh_native.setenv("COLIBRI_NATIVE", "0")
    assert native.load(again=True) == "disabled by COLIBRI_NATIVE=0"
    assert not native.ready and not native.int_ready
    ws = _experts("int8", 0, 1)[0]
    _fallback_matches_torch(ws[0], torch.randn(1, 128).bfloat16())
    assert native_quant_operands(torch.randn(1, 128).bfloat16(), [ws]) is None


def test_cpu_without_vnni_keeps_bf16_kernels_but_not_int(fresh_native):
    flags = native.cpu_flags() - {"avx512_vnni"}
    fresh_native.setattr(native, "cpu_flags", lambda: flags)
    assert native.load(again=True) is None  # bf16 kernels still load
    assert native.ready and not native.int_ready
    _fallback_matches_torch(_experts("int8", 0, 1)[0][0], torch.randn(1, 128).bfloat16())


# What a CPU without AVX512-BF16 loads, asked in a child: this process holds the AVX-512 build already, and a
# second build's ops register under the same names (torch aborts the process on that)
_WITHOUT_AVX512_BF16 = """
import torch
from engine import native
flags = native.cpu_flags() - {"avx512_bf16"}
native.cpu_flags = lambda: flags
assert native.load(again=True) is None, native.load()
assert native.ready and native.isa == "avx2" and not native.int_ready, (native.isa, native.int_ready)
from test_native_int import _experts, _fallback_matches_torch
_fallback_matches_torch(_experts("int8", 0, 1)[0][0], torch.randn(1, 128).bfloat16())
print("avx2 build, no int kernels, torch's int8 product")
"""


def test_cpu_without_avx512_bf16_loads_the_avx2_build_without_int():
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    env.pop("COLIBRI_NATIVE_ISA", None)
    done = subprocess.run([sys.executable, "-c", _WITHOUT_AVX512_BF16], cwd=tests.parent, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("avx2 build, no int kernels, torch's int8 product")


def test_cpu_without_avx512_bf16_or_avx2_loads_nothing(fresh_native):
    flags = native.cpu_flags() - {"avx512_bf16", "avx2"}
    fresh_native.setattr(native, "cpu_flags", lambda: flags)
    assert "lacks avx512_bf16 and avx2" in native.load(again=True)
    assert not native.ready and not native.int_ready and native.isa is None


def test_no_compiler(fresh_native):
    fresh_native.delenv("CXX", raising=False)
    fresh_native.setenv("PATH", "/nonexistent")
    assert native.load(again=True) == "no C++ compiler (g++) on PATH"
    assert not native.int_ready


def test_a_failed_build_is_remembered_not_retried(fresh_native, tmp_path):
    calls = tmp_path / "calls"
    cxx = tmp_path / "broken-g++"
    cxx.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'error: broken compiler' >&2\nexit 1\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    fresh_native.setenv("CXX", str(cxx))
    fresh_native.setenv("COLIBRI_KERNEL_CACHE", str(tmp_path / "kernels"))
    first = native.load(again=True)
    assert "broken compiler" in first and not native.int_ready
    second = native.load(again=True)  # another process or trial: the remembered reason, no build
    assert "broken compiler" in second and "earlier build" in second
    assert calls.read_text().count("x") == 1
    failed = list((tmp_path / "kernels").glob("*.failed"))
    assert len(failed) == 1
    os.unlink(failed[0])  # deleting the marker retries
    native.load(again=True)
    assert calls.read_text().count("x") == 2


@pytest.mark.parametrize("part,value", [(0, float("nan")), (0, float("inf")), (0, 0.0), (0, -1.0),
                                        (1, float("nan")), (1, float("-inf"))])
def test_int4_strips_refuse_bad_scales_before_writing(part, value):
    """The repack checks the scales (check_scales' test, on the strips' path) before it writes: a bad
    scale or zero in the last pair is a ModelFormatError, and the bytes it would have repacked over
    are left as they were."""
    from engine.base.errors import ModelFormatError
    qw, qs = quantize(torch.randn(130, 96, generator=torch.Generator().manual_seed(1)), "int4", 32)
    qs[-1, -1, part] = value
    joined = torch.cat([qw.reshape(-1), qs.view(torch.uint8).reshape(-1)])
    before = joined.clone()
    with pytest.raises(ModelFormatError, match="scales hold NaN, Inf, zero or negative values"):
        QuantWeight.prepare(joined[:qw.numel()].view(qw.shape), joined[qw.numel():].view(torch.bfloat16).view(qs.shape),
                            "int4", 32, torch.bfloat16, joined=joined)
    assert torch.equal(joined, before)


@pytest.mark.parametrize("n,k,group", [(130, 96, 32), (512, 1024, 64), (70, 256, 128)])
def test_int4_prefill_rows_equal_the_decode_rows(n, k, group):
    """int4_linear over M rows (prefill: four activation rows a pass over a strip, the rest one at a
    time, the tail rows scalar) gives every row the bits of a one-row call (decode)."""
    g = torch.Generator().manual_seed(n + group)
    qw, qs = quantize(torch.randn(n, k, generator=g), "int4", group)
    weight = QuantWeight.prepare(qw, qs, "int4", group, torch.bfloat16)
    x = torch.randn(7, k, generator=g).bfloat16()  # 4 + 3: one four-row pass, three single rows
    assert torch.equal(weight.linear(x), torch.cat([weight.linear(x[i:i + 1]) for i in range(7)]))
