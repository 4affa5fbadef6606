"""Native decode kernels (bf16, int8/int4, FP8, MXFP4 *.cpp): built on first use, loaded as torch ops, optional.

Decode (one token) in bf16 is a stream of matrix-vector products; torch's bf16 matmul is tuned
for many rows and reaches a quarter of the memory bandwidth there (docs/BENCHMARKS.md,
"Resident decode"). The kernels here are plain dot products with AVX512-BF16 instructions. On a CPU
without AVX512-BF16 but with AVX2 and FMA they are built over avx2_compat.h (each 512-bit vector two
256-bit halves, vdpbf16ps two FMAs): every op but the int8/int4 ones, the same guarantees (a row's bits
follow neither the rows beside it nor its place in a vector), other bits than the AVX-512 build's.

They are built with the system C++ compiler against the installed torch's headers the first
time a bf16 engine starts (~6 s), into ~/.cache/colibri/kernels (COLIBRI_KERNEL_CACHE),
keyed by the source, torch version, compiler and CPU flags; the build writes a temp file and
renames it, so concurrent first runs are safe. A build that fails is remembered beside the
library (`<name>.failed`, holding the compiler's last line): later runs, and every trial of a
tune, read the reason instead of compiling again, until the sources, torch or the compiler
change (they key the name). Without a compiler, without AVX512-BF16 and AVX2, or with COLIBRI_NATIVE=0,
`load()` says why and the engine keeps torch's ops: same model, other rounding of the sums, so
tokens may differ from a native run (never between placements of one).

The int8/int4 kernels (int_decode.cpp) also need AVX512-VNNI and VBMI (INT_FLAGS); without them
`int_ready` stays False and quantized weights keep torch's packed kernels (engine/weights/quantized.py).

    load() -> str | None    load the ops; None when ready, else why not (one line)
    ready                   whether they are loaded (checked on the decode path)
    int_ready               whether the int8/int4 ops may run too (ready and INT_FLAGS present)
    linear(x, w)            x [M,K] @ w.T, bf16; each row the bits of a 1-row call (a weight row read once for all M)
    experts(x, weights, n)  SwiGLU of several experts on one token: [E, H]
    experts_rows(x, weights, n, slot_row, slot_expert)   batched decode: slot s = expert slot_expert[s] on
                            row slot_row[s] of x [M, H] (slots sorted by expert): [S, H], each slot the bits
                            of experts() on that row with that expert alone, each expert read once
    rms_norm(x, w, eps)     per row of x [..., H] (moe_decode.cpp)
    route_topk(x, w, k, norm)          softmax top-k routing of T tokens, each alone: ids [T,k], weights [T,k]
    route_sigmoid_group(x, w, bias, k, n_group, topk_group, norm, scale)  the sigmoid-group rule
                                       (deepseek_v3, glm4_moe) of T tokens, each alone (bf16_decode.cpp)
    combine(ys, weights)               sum of the K experts' rows, weighted: [1, H]; weights [B, K]: B rows
    moe_layer(h, ...)       a whole MoE layer of one token, residual included, a routing trim applied
                            when given (reduction, threshold, renormalize; engine/arch/moe.py)
    attention_decode(x, ...)           a layer's attention half of one token, K/V written (attention_decode.cpp;
                                       the cache bf16, or int8 / fp8 codes + scales)
    attention_decode_rows(x, ..., k_caches, v_caches, positions, ...)  attention_decode for B rows (a batched
                                       step), each its own caches and position; the weights read once for
                                       all rows, each row attention_decode's bits on it alone
    decode_layers(x, ...)   every layer of one token: attention half + fused MoE per layer (decode_step.cpp)
    decode_layers_rows(x, attention, row_cache, ...)  decode_layers for M rows in one call (a batched step, or
                            a verify's consecutive positions of one cache): each layer's weights read once for
                            all rows, each row decode_layers' bits on it alone
    mxfp4_linear(x, blocks, scales, bias)  x @ dequant(blocks, scales).T + bias, fp32 or bf16
    fp8_linear(x, w, scale, block)         x [M,K] @ dequant(w).T in x's dtype (bf16 or fp32), FP8 e4m3 w with
                                           one fp32 scale per block (fp8_decode.cpp; engine/weights/fp8.py)
    int8_linear(x, codes, scales)          x @ (codes * scales).T, per-row scales; each row of x the bits of a
                                           1-row call (as int4_linear's)
    int4_linear(x, strips, group)          x @ dequant_int4(...).T, W in the engine's int4 strips, any rows
    int4_strips(packed, scales_zeros, group, out)  the stored int4 pair → strips (in place where out is its bytes)
    quant_experts(x, weights, group)       SwiGLU of several int8 (group 0) / int4 experts: [E, H]
    quant_experts_rows(x, weights, group, slot_row, slot_expert)  experts_rows for int8 / int4 experts
    moe_layer_int(h, ..., group)           moe_layer for int8 / int4 experts (moe_decode_int.cpp; engine/arch/moe_quant.py)
    attention_decode_int(x, ..., proj, group)  attention_decode with int8 / int4 q/k/v/o (attention_decode_int.cpp;
                                       engine/arch/attention_quant.py)
    attention_decode_int_rows(x, ...)      attention_decode_rows with int8 / int4 q/k/v/o
    decode_layers_int(x, ...)              decode_layers for int8 / int4 projections and experts (decode_step_int.cpp)
    decode_layers_int_rows(x, ...)         decode_layers_rows for int8 / int4 projections and experts
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

# Every .cpp here goes into the one library (each registers its ops in namespace colibri, the int8/int4
# ones in colibri_int).
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources: part of the key
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
INT_FLAGS = ("avx512_vnni", "avx512vbmi")
# Without AVX512-BF16, a CPU with AVX2 and FMA gets the same kernels built over avx2_compat.h (each
# 512-bit vector a pair of 256-bit halves, vdpbf16ps two FMAs): every bf16 / FP8 / MXFP4 op, not the
# int8/int4 ones (their VNNI and VBMI arithmetic is not emulated; int_ready stays False).
AVX2_FLAGS = ("avx2", "fma")
INT_SOURCES = tuple(s for s in SOURCES if s.stem.endswith("_int") or s.stem.startswith("int_"))
COMPAT_HEADER = Path(__file__).parent / "avx2_compat.h"
ISAS = ("avx512", "avx2")
# int8 decode through the native op: on by default since its rows prefetch the next tile and resident
# layers run fused (demo int8 resident: 1.6x torch's _weight_int8pack_mm end to end, docs/BENCHMARKS.md,
# "intkern"); COLIBRI_NATIVE_INT8=0 keeps torch's kernel. int4 has no switch.
int8_decode = os.environ.get("COLIBRI_NATIVE_INT8", "1") == "1"
ready = False
int_ready = False
isa: str | None = None  # the loaded build: "avx512" or "avx2" (avx2_compat.h), None when not ready
_why_not: str | None = None
_tried = False


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def runnable_isas(flags: set[str]) -> list[str]:
    """The builds a CPU with these flags can run, the preferred first: avx512 (AVX512-BF16), avx2 (AVX2 and FMA)."""
    return [name for name, wanted in (("avx512", REQUIRED_FLAGS), ("avx2", AVX2_FLAGS))
            if all(f in flags for f in wanted)]


def isa_for(flags: set[str]) -> str | None:
    """Which build a CPU with these flags runs: avx512, avx2, or None (torch's ops). COLIBRI_NATIVE_ISA=avx2
    takes the AVX2 build on an AVX-512 CPU too (how CI runs the emulation where its CPU has AVX-512)."""
    runs = runnable_isas(flags)
    if os.environ.get("COLIBRI_NATIVE_ISA") == "avx2":
        return "avx2" if "avx2" in runs else None
    return runs[0] if runs else None


def build(out: Path, optimize: bool = True, isa: str = "avx512") -> None:
    """Compile the library for `isa` to `out` whatever this CPU runs (CI checks both builds compile on any
    CPU: unoptimized where it cannot run them, a check of the sources and the link, not a library to run).
    Raises RuntimeError naming what failed."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    _build(cxx, out, "-O3" if optimize else "-O0", isa)


def _build(cxx: str, out: Path, level: str = "-O3", isa: str = "avx512") -> None:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    if isa == "avx512":
        target, sources = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"], SOURCES
    else:
        target = ["-mavx2", "-mfma", "-include", str(COMPAT_HEADER)]
        sources = tuple(s for s in SOURCES if s not in INT_SOURCES)
    argv = [cxx, level, "-std=c++17", "-shared", "-fPIC", "-fopenmp", *target, f"-I{Path(__file__).parent}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", f"-I{torch_dir / 'include'}", *map(str, sources), "-o", str(out),
            f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{cxx} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")


def _library_path(cxx: str, flags: set[str], isa: str = "avx512") -> Path:
    """Where the `isa` build of these sources lies in the kernel cache: keyed by the sources, torch, the
    compiler and the CPU flags that build compiles for (an AVX2 build's by AVX2's and FMA's alone: whether
    the CPU also has AVX-512 does not change it, so a CPU's AVX2 build and COLIBRI_NATIVE_ISA=avx2's are
    one library, built once)."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    wanted = REQUIRED_FLAGS if isa == "avx512" else AVX2_FLAGS
    key.update(f"{torch.__version__}|{cxx}|{platform.machine()}|{sorted(flags & set(wanted))}".encode())
    if isa != "avx512":  # (the AVX-512 build's key as it always was: its cached libraries stay valid)
        key.update(f"|{isa}".encode())
    root = Path(os.environ.get("COLIBRI_KERNEL_CACHE") or Path.home() / ".cache" / "colibri" / "kernels")
    return root / f"colibri_bf16_{key.hexdigest()[:16]}.so"


def load(again: bool = False) -> str | None:
    """Load the native ops (building them first if needed). None when ready, else the reason.

    The answer is kept for the process; again=True asks once more (after installing a compiler,
    or in tests that change the environment). A library already loaded stays loaded."""
    global ready, int_ready, isa, _why_not, _tried
    if _tried and not again:
        return _why_not
    _tried = True
    flags = cpu_flags()
    chosen = isa_for(flags)
    _why_not = _load(flags, chosen)
    ready = _why_not is None
    isa = chosen if ready else None
    int_ready = ready and isa == "avx512" and all(f in flags for f in INT_FLAGS)
    return _why_not


def _load(flags: set[str], chosen: str | None) -> str | None:
    if os.environ.get("COLIBRI_NATIVE", "1") == "0":
        return "disabled by COLIBRI_NATIVE=0"
    if chosen is None:
        wide = [f for f in REQUIRED_FLAGS if f not in flags]
        narrow = [f for f in AVX2_FLAGS if f not in flags]
        if not wide:  # (COLIBRI_NATIVE_ISA=avx2 on a CPU without AVX2)
            return f"this CPU lacks {', '.join(narrow)} (COLIBRI_NATIVE_ISA=avx2)"
        return f"this CPU lacks {', '.join(wide)} and {', '.join(narrow)} (the AVX-512 kernels and their AVX2 build)"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (g++) on PATH"
    lib = _library_path(cxx, flags, chosen)
    failed = lib.with_suffix(".failed")
    if not lib.exists() and failed.exists():
        return f"native kernels unavailable: {_read_failure(failed)} (an earlier build; delete {failed} to retry)"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=lib.stem, suffix=".so.partial", dir=lib.parent)
            os.close(fd)
            try:
                try:
                    _build(cxx, Path(tmp), isa=chosen)
                except (RuntimeError, subprocess.SubprocessError) as exc:
                    _remember_failure(failed, str(exc))
                    raise
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"native kernels unavailable: {exc}"
    return None


def _remember_failure(path: Path, why: str) -> None:
    """Write the failed build's reason beside the library (temp + rename: a reader sees all or nothing)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".failed.partial", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(why[:400] + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache: the next run tries again, nothing worse


def _read_failure(path: Path) -> str:
    try:
        return path.read_text().strip() or "the build failed"
    except OSError:
        return "the build failed"


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias [N], added before the one rounding): row m's bits whatever M."""
    return torch.ops.colibri.linear_bf16(x, w, bias)


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x [M, K] @ bf16 w [N, K].T in fp32, w widened in registers (no fp32 copy of it); row m's
    bits whatever M."""
    return torch.ops.colibri.linear_f32_bf16w(x, w)


def experts(x: torch.Tensor, weights: list, per_expert: int) -> torch.Tensor:
    return torch.ops.colibri.experts_bf16(x, weights, per_expert)


def experts_rows(x: torch.Tensor, weights: list, per_expert: int, slot_row: torch.Tensor,
                 slot_expert: torch.Tensor) -> torch.Tensor:
    """Batched decode's experts: x [M, H] bf16, weights as experts() takes them (E experts), slot_row /
    slot_expert int64 [S] sorted by expert → [S, H], slot s = expert slot_expert[s] on row slot_row[s],
    bit for bit experts(x[r:r+1], [that expert's tensors], per_expert)."""
    return torch.ops.colibri.experts_rows_bf16(x, weights, per_expert, slot_row, slot_expert)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.colibri.rms_norm_bf16(x, w, eps)


def route_topk(x: torch.Tensor, w: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.colibri.route_topk_bf16(x, w, k, norm)


def route_sigmoid_group(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                        norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.colibri.route_sigmoid_group_bf16(x, w, bias, k, n_group, topk_group, norm, scale)


def combine(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ys [K, H], weights [K] → [1, H]; or ys [B*K, H] (row b's K slots together), weights [B, K] → [B, H]."""
    return torch.ops.colibri.combine_bf16(ys, weights)


def moe_layer(h: torch.Tensor, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, k: int, norm: bool,
              experts: torch.Tensor, inter: int, reduction: int = 0, threshold: float = 0.0,
              renormalize: bool = False) -> torch.Tensor:
    return torch.ops.colibri.moe_layer_bf16(h, norm_w, eps, router_w, k, norm, experts, inter, reduction, threshold,
                                            renormalize)


# int4 strips hold their scales: the ops' scales argument is this one empty tensor.
_NO_SCALES = torch.empty(0, dtype=torch.bfloat16)
# A bf16 cache's scales: none (one empty tensor for every call, not one per token).
NO_SCALES = torch.empty(0, dtype=torch.float32)


def attention_decode(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, q_norm: torch.Tensor,
                     k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: int, heads: int, kv_heads: int, o_w: torch.Tensor,
                     k_scales: torch.Tensor = NO_SCALES, v_scales: torch.Tensor = NO_SCALES,
                     qkv_b: torch.Tensor | None = None, rot: int = 0) -> torch.Tensor:
    """k_cache/v_cache: bf16 [Nkv, ctx, D], or int8 / float8_e4m3fn codes with k_scales/v_scales
    [Nkv, ctx] fp32 (a QuantizedRows' codes and scales). qkv_b: the q/k/v biases (fused as qkv_w is),
    or None; rot: the rotary dims of a head (0: all D; fewer: partial rotary, cos/sin [rot])."""
    return torch.ops.colibri.attention_decode_bf16(x, norm_w, eps, qkv_w, q_norm, k_norm, cos, sin, k_cache, v_cache,
                                                   k_scales, v_scales, pos, heads, kv_heads, o_w, qkv_b, rot)


def attention_decode_rows(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                          q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_caches: list, v_caches: list, positions: list[int], heads: int, kv_heads: int,
                          o_w: torch.Tensor, k_scales: list | None = None, v_scales: list | None = None,
                          qkv_b: torch.Tensor | None = None, rot: int = 0) -> torch.Tensor:
    """attention_decode for B rows of a batched step: x [B, H], cos/sin [B, D] (row b's rope row), row b
    with its own caches k_caches[b] / v_caches[b] (bf16, or int8 / fp8 codes with k_scales[b] /
    v_scales[b]; None: bf16 caches) at positions[b]; the weights read once for all rows, row b bit for
    bit attention_decode on row b alone. Rows sharing a cache (a verify) come in increasing positions."""
    none = [NO_SCALES] * len(k_caches)
    return torch.ops.colibri.attention_decode_rows_bf16(x, norm_w, eps, qkv_w, q_norm, k_norm, cos, sin, k_caches,
                                                        v_caches, none if k_scales is None else k_scales,
                                                        none if v_scales is None else v_scales, positions, heads,
                                                        kv_heads, o_w, qkv_b, rot)


def decode_layers(x: torch.Tensor, attention: list, moe: list, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                  heads: int, kv_heads: int, eps: float, k: int, norm: bool, inter: int, reduction: int = 0,
                  threshold: float = 0.0, renormalize: bool = False) -> torch.Tensor:
    return torch.ops.colibri.decode_layers_bf16(x, attention, moe, cos, sin, pos, heads, kv_heads, eps, k, norm, inter,
                                                reduction, threshold, renormalize)


def decode_layers_rows(x: torch.Tensor, attention: list, row_cache: list[int], moe: list, cos: torch.Tensor,
                       sin: torch.Tensor, positions: list[int], heads: int, kv_heads: int, eps: float, k: int,
                       norm: bool, inter: int, reduction: int = 0, threshold: float = 0.0,
                       renormalize: bool = False) -> torch.Tensor:
    """decode_layers for M rows: x [M, H], cos/sin [M, D]; attention: C caches' decode_layers lists one
    after the other (the same weights, each its own caches); row r at positions[r] of cache
    row_cache[r] (rows of one cache in increasing positions) → [M, H], row r bit for bit
    decode_layers on row r alone, each layer's weights read once for all rows."""
    return torch.ops.colibri.decode_layers_rows_bf16(x, attention, row_cache, moe, cos, sin, positions, heads,
                                                     kv_heads, eps, k, norm, inter, reduction, threshold, renormalize)


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.colibri.mxfp4_linear(x, blocks, scales, bias)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return torch.ops.colibri_fp8.linear(x, w, scale, block[0], block[1])


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.colibri_int.int8_linear(x, codes, scales)


def int4_linear(x: torch.Tensor, strips: torch.Tensor, group: int) -> torch.Tensor:
    """x @ W.T for W in the strip layout (engine/weights/quantized.py pack_int4_strips), any number of rows."""
    return torch.ops.colibri_int.int4_linear(x, strips, _NO_SCALES, group)


def int4_strips(packed: torch.Tensor, scales_zeros: torch.Tensor, group: int, out: torch.Tensor) -> bool:
    """The stored int4 pair (codes [N, K/2], bf16 scales_zeros [K/g, N, 2]) → strips, into `out`
    ([N, K/2 + 4K/g] uint8), which may be the pair's own bytes (codes then scales, adjacent).
    False, `out` untouched, where a scale is not finite and > 0 or a zero not finite."""
    return torch.ops.colibri_int.int4_strips(packed, scales_zeros, group, out)


def quant_experts(x: torch.Tensor, weights: list, group: int) -> torch.Tensor:
    return torch.ops.colibri_int.experts(x, weights, group)


def quant_experts_rows(x: torch.Tensor, weights: list, group: int, slot_row: torch.Tensor,
                       slot_expert: torch.Tensor) -> torch.Tensor:
    """experts_rows for int8 (group 0) / int4 experts given as quant_experts takes them: [S, H], slot s
    bit for bit quant_experts(x[r:r+1], that expert's 6 tensors, group). Needs int_ready."""
    return torch.ops.colibri_int.experts_rows(x, weights, group, slot_row, slot_expert)


def moe_layer_int(h: torch.Tensor, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, k: int, norm: bool,
                  experts: torch.Tensor, inter: int, group: int, reduction: int = 0, threshold: float = 0.0,
                  renormalize: bool = False) -> torch.Tensor:
    return torch.ops.colibri_int.moe_layer_int(h, norm_w, eps, router_w, k, norm, experts, inter, group, reduction,
                                               threshold, renormalize)


def attention_decode_int(x: torch.Tensor, norm_w: torch.Tensor, eps: float, proj: list, group: int,
                         q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int, heads: int, kv_heads: int,
                         k_scales: torch.Tensor = NO_SCALES, v_scales: torch.Tensor = NO_SCALES) -> torch.Tensor:
    """attention_decode with quantized projections: proj = q, k, v, o codes and scales (8 tensors, the
    stored layouts), group 0 = int8, else int4's group. Needs int_ready (VNNI/VBMI)."""
    return torch.ops.colibri_int.attention_decode_int(x, norm_w, eps, proj, group, q_norm, k_norm, cos, sin, k_cache,
                                                      v_cache, k_scales, v_scales, pos, heads, kv_heads)


def attention_decode_int_rows(x: torch.Tensor, norm_w: torch.Tensor, eps: float, proj: list, group: int,
                              q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              k_caches: list, v_caches: list, positions: list[int], heads: int, kv_heads: int,
                              k_scales: list | None = None, v_scales: list | None = None) -> torch.Tensor:
    """attention_decode_int for B rows, as attention_decode_rows takes them: row b bit for bit
    attention_decode_int on row b alone, each projection read once for all rows. Needs int_ready."""
    none = [NO_SCALES] * len(k_caches)
    return torch.ops.colibri_int.attention_decode_int_rows(x, norm_w, eps, proj, group, q_norm, k_norm, cos, sin,
                                                           k_caches, v_caches, none if k_scales is None else k_scales,
                                                           none if v_scales is None else v_scales, positions, heads,
                                                           kv_heads)


def decode_layers_int(x: torch.Tensor, attention: list, moe: list, cos: torch.Tensor, sin: torch.Tensor, pos: int,
                      heads: int, kv_heads: int, eps: float, k: int, norm: bool, inter: int, attn_group: int,
                      moe_group: int, reduction: int = 0, threshold: float = 0.0,
                      renormalize: bool = False) -> torch.Tensor:
    return torch.ops.colibri_int.decode_layers_int(x, attention, moe, cos, sin, pos, heads, kv_heads, eps, k, norm,
                                                   inter, attn_group, moe_group, reduction, threshold, renormalize)


def decode_layers_int_rows(x: torch.Tensor, attention: list, row_cache: list[int], moe: list, cos: torch.Tensor,
                           sin: torch.Tensor, positions: list[int], heads: int, kv_heads: int, eps: float, k: int,
                           norm: bool, inter: int, attn_group: int, moe_group: int, reduction: int = 0,
                           threshold: float = 0.0, renormalize: bool = False) -> torch.Tensor:
    """decode_layers_rows for int8 / int4 projections and experts (decode_layers_int's lists). Needs int_ready."""
    return torch.ops.colibri_int.decode_layers_int_rows(x, attention, row_cache, moe, cos, sin, positions, heads,
                                                        kv_heads, eps, k, norm, inter, attn_group, moe_group,
                                                        reduction, threshold, renormalize)
