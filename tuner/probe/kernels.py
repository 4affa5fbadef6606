"""Expert-kernel throughput at decode shape: bf16, int8 and int4, through the engine's own kernels.

The cost model charges a token's expert matmuls at the rate of the kernel that computes them.
bf16 goes through `engine.weights.stored.linear`, as the engine calls it: one row (decode) on the native
AVX512-BF16 kernel (or its AVX2 build) when engine/native loads on this machine, `F.linear` otherwise.
A quantized expert is not multiplied by `F.linear`: the engine runs `QuantWeight.linear`
(engine/weights/quantized.py), i.e. `aten._weight_int8pack_mm` for int8, `aten._weight_int4pack_mm_for_cpu`
for int4, or dequantize-then-matmul where the packed op refuses the shape on this build. Those
kernels' speed has little to do with the bf16 GEMV's (the int4 one unpacks nibbles, the int8 one
converts codes), so each is measured here, through `QuantWeight` itself: the point records which
kernel the engine picked, and a fallback is timed as the fallback.

Shapes: x[m, k] times W[n, k]^T with (k, n) = one expert projection of the demo preset (hidden
1024, intermediate 512) and of a large MoE (GLM-5: hidden 6144, intermediate 2048); m = 1 (a
decode GEMV) and a few rows (prefill's tokens per expert). `prepare_time` is what turning a
stored matrix into the kernel's operand costs (paid once per expert read from disk).

Quick by design (about a second): each timing lasts `min_time_s`, the weights are quantized
once per shape and reused across thread counts.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from engine.api import QuantWeight, linear, load_native_kernels, native_kernels_ready, quantize
from tuner.probe.cpu import time_calls, each_thread_count
from tuner.probe.hardware_profile import KERNEL_QUANTS, ExpertKernelPoint, Quantity

SHAPES = ((1024, 512), (6144, 2048))  # (k, n): demo-like and GLM-5-like expert projections
INT4_GROUP = 64  # the containers' default group (engine/format/convert.py), the cost model's int4
NATIVE_BF16 = "engine.native.linear"
PREPARE_REPEATS = 5  # median of 5: a repack on another CPU's layout takes tens of ms, a view microseconds


def measure_kernels(thread_counts: Sequence[int], ms: Sequence[int], min_time_s: float,
                    shapes: Sequence[tuple[int, int]] = SHAPES,
                    on_step: Callable[[str], None] | None = None) -> list[ExpertKernelPoint]:
    import torch

    weights = _weights(shapes)
    points = []
    for threads, quant in each_thread_count(thread_counts, KERNEL_QUANTS, "expert kernels", on_step):
        for (k, n) in shapes:
            fn_of, kernel, prepare_s = _kernel(quant, weights[(k, n)])
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                calls, elapsed = time_calls(fn_of(x), min_time_s)
                per_call = elapsed / calls
                points.append(ExpertKernelPoint(
                    quant=quant, kernel=_bf16_kernel(m) if quant == "bf16" else kernel, group_size=INT4_GROUP if quant == "int4" else None,
                    m=m, k=k, n=n, threads=threads, calls=calls,
                    throughput=Quantity(2.0 * m * k * n / per_call / 1e9, "GFLOP/s"),
                    time_per_call=Quantity(per_call * 1e6, "us"),
                    prepare_time=Quantity(prepare_s * 1e6, "us")))
    return points


def _bf16_kernel(m: int) -> str:
    return NATIVE_BF16 if native_kernels_ready() and m == 1 else "F.linear"


def _weights(shapes) -> dict:
    """bf16 weight and its stored int8 / int4 forms per shape (quantized once: the slow part)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = {}
    for k, n in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        out[(k, n)] = {"bf16": w.to(torch.bfloat16), "int8": quantize(w, "int8", INT4_GROUP),
                       "int4": quantize(w, "int4", INT4_GROUP)}
    return out


def _kernel(quant: str, forms: dict):
    """(x → call, kernel name, seconds to prepare the stored matrix) as the engine runs it."""
    import torch

    if quant == "bf16":
        w = forms["bf16"]
        # engine.weights.stored.linear is the engine's call: the native kernel for one bf16 row when it
        # loads (engine/native; built once per machine, as the first bf16 engine would), else F.linear.
        load_native_kernels()
        return (lambda x: (lambda: linear(x, w))), "F.linear", 0.0
    qweight, qscale = forms[quant]
    QuantWeight.prepare(qweight, qscale, quant, INT4_GROUP, torch.bfloat16)  # kernel choice, cached
    times = []
    for _ in range(PREPARE_REPEATS):
        t0 = time.perf_counter()
        qw = QuantWeight.prepare(qweight, qscale, quant, INT4_GROUP, torch.bfloat16)
        times.append(time.perf_counter() - t0)
    return (lambda x: (lambda: qw.linear(x))), qw.kernel, statistics.median(times)
