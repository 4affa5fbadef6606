// The int8 (per-row scales) and int4 group-wise decode kernels for the stored container layouts
// (docs/FORMAT.md), and the SwiGLU of a set of quantized experts on one token. Header-only (inline),
// included by int_decode.cpp (the separate ops) and moe_decode_int.cpp (the fused MoE layer), so an
// expert computed by either is the same code, the same order of sums and the same bits.
//
// AVX512-VNNI integer dot products (vpdpwssd) and, for int4, the nibbles unpacked in registers
// (AVX512-VBMI byte permutes). Why: torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`
// convert every weight to fp32 and multiply in fp32 (three vector instructions per 16 weights),
// which makes a decode token compute-bound on 2 cores; here a weight costs one sign/zero-extension
// and half of one vpdpwssd (32 products per instruction).
//
// Activations: the row x is quantized once per call to int16 with one scale, sx = max|x| / 32767
// (the error, <= max|x| / 65534 per element, is well under bf16's own rounding of x for all but
// the smallest elements), then dot products are exact int32 sums, flushed to fp32 per 2048
// inputs (int8) or per group (int4) before they could overflow.
//
//   int8:  y[n] = scale[n] * sx * sum_k q[n,k] xq[k]
//   int4:  y[n] = sum over groups g of scale[g,n] * sx * (sum_k c[n,k] xq[k] - 8 sum_k xq[k])
//                                    + zero[g,n] * sum_k x[k]          (k in group g; c = code 0..15)
//
// int4 layout (pack_int4): rows in blocks of 64, k-major inside a block: the 32 bytes of (block,
// k) hold row j's code (low nibble) and row j+32's (high), so the 64 bytes of k and k+1 are one
// load, and four byte permutes turn them into (code[r,k], code[r,k+1]) int16 pairs for 64 rows.
// A last block of fewer than 64 rows (pairs n, n+1 per byte) takes a scalar path.
//
// Determinism: every output is computed by one thread in one fixed order whatever the thread
// count or the split, so an expert alone (streaming) and inside a batched or fused call (resident)
// give the same bits (the placement-invariance tests rely on it). Roundings of the SwiGLU follow
// experts_bf16 (bf16_kernels.h): gate and up products, silu and their product each rounded to the
// compute dtype (bf16 only).
//
// The VNNI/VBMI code is compiled for those instruction sets only (push/pop around it: the library
// is built for AVX512-BF16 CPUs, some of which lack VBMI); engine/native/__init__.py calls these
// ops only where /proc/cpuinfo lists both (INT_FLAGS). An includer puts its own ops that call them
// inside COLIBRI_INT_TARGET_BEGIN / END as well.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "native_common.h"

#define COLIBRI_INT_TARGET_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512vnni,avx512vbmi\")")
#define COLIBRI_INT_TARGET_END _Pragma("GCC pop_options")

COLIBRI_INT_TARGET_BEGIN

namespace colibri_int_kernels {

using namespace colibri_native;



constexpr float XQ_MAX = 32767.0f;
constexpr int64_t INT8_FLUSH = 2048;  // inputs per int32 partial: 2048/32 steps x 2 x 127 x 32767 < 2^31
constexpr int64_t BLOCK = 64;         // int4 rows per packed block

// Software prefetch distance (int4): 1 KiB of codes ahead, and the next block's scales. Measured from
// DRAM (docs/BENCHMARKS.md, "intkern"): without them the scales' one 256-byte run per group 2+ KiB
// apart each starts a hardware-prefetch stream too late (int4 17-18 -> 24 GB/s).
constexpr int64_t INT4_AHEAD = 1024;  // bytes of codes; past the matrix's end is harmless

// One activation row, quantized: int16 codes (padded with zeros to a multiple of 64), its scale,
// and per int4 group the sum of the codes and of the real values.
struct QuantRow {
  std::vector<int16_t> q;
  float sx = 0.0f;
  std::vector<int32_t> qsum;
  std::vector<float> xsum;

  void set(const float* x, int64_t K, int64_t group) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
    sx = amax / XQ_MAX;
    const float inv = amax > 0.0f ? XQ_MAX / amax : 0.0f;
    q.assign((K + 63) / 64 * 64, 0);
    for (int64_t k = 0; k < K; k++) q[k] = (int16_t)std::nearbyint(x[k] * inv);
    if (group > 0) {
      const int64_t G = K / group;
      qsum.assign(G, 0);
      xsum.assign(G, 0.0f);
      for (int64_t g = 0; g < G; g++)
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
          qsum[g] += q[k];
          xsum[g] += x[k];
        }
    }
  }
};

// A quantized matrix as its kernel reads it.
struct QMat {
  int64_t N = 0, K = 0, group = 0;  // group 0: int8
  const int8_t* codes = nullptr;    // int8 [N, K]
  const uint8_t* packed = nullptr;  // int4 [N, K/2], blocked
  const void* scales = nullptr;     // int8: [N]; int4: [K/g, N, 2]
  bool scales_f32 = false;

  float scale_at(int64_t i) const {
    return scales_f32 ? static_cast<const float*>(scales)[i] : to_f32(static_cast<const bf16*>(scales)[i]);
  }
};

inline QMat int8_mat(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2, "int8 codes must be int8 [N, K]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == codes.size(0), "int8 scales must be [N]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat, "scales: bf16 or fp32");
  check_cpu_contiguous(codes, "int8 codes");
  check_cpu_contiguous(scales, "int8 scales");
  QMat m;
  m.N = codes.size(0);
  m.K = codes.size(1);
  m.codes = codes.data_ptr<int8_t>();
  m.scales = scales.data_ptr();
  m.scales_f32 = scales.scalar_type() == at::kFloat;
  return m;
}

inline QMat int4_mat(const at::Tensor& packed, const at::Tensor& sz, int64_t group) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "int4 codes must be uint8 [N, K/2]");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "int4 group must be 32, 64 or 128");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % 2 == 0 && K % group == 0, "int4: N must be even and the group must divide K");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "int4 scales_zeros must be [K/group, N, 2]");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kFloat, "scales: bf16 or fp32");
  check_cpu_contiguous(packed, "int4 codes");
  check_cpu_contiguous(sz, "int4 scales_zeros");
  QMat m;
  m.N = N;
  m.K = K;
  m.group = group;
  m.packed = packed.data_ptr<uint8_t>();
  m.scales = sz.data_ptr();
  m.scales_f32 = sz.scalar_type() == at::kFloat;
  return m;
}

// --- int8 ---------------------------------------------------------------------------------

// Row n of m against x: one sequential pass over the row (the hardware prefetcher follows one
// stream best, as bf16's dot_rows), two accumulator chains over alternate 32-input blocks
// (vpdpwssd's latency, not its throughput, bounds a single chain). The chains' int32 sums are exact,
// so their total per flush is the one-chain sum: the bits of the 4-row tiles with software prefetch
// this replaced, whose resident int8 decode it runs 1.16x (AMD EPYC; docs/BENCHMARKS.md, "The int8
// decode kernel one row at a time").
inline float int8_row(const QMat& m, int64_t n, const QuantRow& x) {
  const int16_t* xq = x.q.data();
  const int8_t* w = m.codes + n * m.K;
  __m512 accf = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < m.K; k0 += INT8_FLUSH) {
    const int64_t k1 = std::min(m.K, k0 + INT8_FLUSH);
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      a0 = _mm512_dpwssd_epi32(a0, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k))),
                               _mm512_loadu_si512(xq + k));
      a1 = _mm512_dpwssd_epi32(a1, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32))),
                               _mm512_loadu_si512(xq + k + 32));
    }
    if (k + 32 <= k1) {
      a0 = _mm512_dpwssd_epi32(a0, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k))),
                               _mm512_loadu_si512(xq + k));
      k += 32;
    }
    if (k < k1) {  // xq is zero-padded; the weights are loaded under a mask
      const __mmask32 mask = (__mmask32)((1ull << (k1 - k)) - 1);
      a1 = _mm512_dpwssd_epi32(a1, _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k)), _mm512_loadu_si512(xq + k));
    }
    accf = _mm512_add_ps(accf, _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)));
  }
  return _mm512_reduce_add_ps(accf) * x.sx * m.scale_at(n);
}

// Any row range, row by row. A row's result does not depend on the range it is in, so every split
// gives the same bits.
inline void int8_range(const QMat& m, const QuantRow& x, int64_t begin, int64_t end, float* out) {
  for (int64_t n = begin; n < end; n++) out[n - begin] = int8_row(m, n, x);
}

// --- int4 ---------------------------------------------------------------------------------

// Byte indices turning [codes of k (32 rows) | codes of k+1 (32 rows)] into 16 lanes of
// (code[r,k], 0, code[r,k+1], 0): rows 0-15 (LOW) and 16-31 (HIGH) of the 32.
struct PairIndex {
  __m512i low, high;
  PairIndex() {
    alignas(64) uint8_t a[64], b[64];
    for (int r = 0; r < 16; r++) {
      a[4 * r] = (uint8_t)r;
      a[4 * r + 2] = (uint8_t)(32 + r);
      b[4 * r] = (uint8_t)(16 + r);
      b[4 * r + 2] = (uint8_t)(48 + r);
      a[4 * r + 1] = a[4 * r + 3] = b[4 * r + 1] = b[4 * r + 3] = 0;
    }
    low = _mm512_load_si512(a);
    high = _mm512_load_si512(b);
  }
};
constexpr __mmask64 EVEN_BYTES = 0x5555555555555555ull;

// 16 rows' (scale, zero) of group g as fp32 vectors.
inline void load_scale_zero(const QMat& m, int64_t g, int64_t r0, __m512& s, __m512& z) {
  if (!m.scales_f32) {  // dword = scale (low bf16) | zero (high bf16)
    const __m512i d = _mm512_loadu_si512(static_cast<const bf16*>(m.scales) + (g * m.N + r0) * 2);
    s = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
    z = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
  } else {
    const float* p = static_cast<const float*>(m.scales) + (g * m.N + r0) * 2;
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    s = _mm512_permutex2var_ps(a, even, b);
    z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  }
}

// 64 outputs of full block `nb` (rows nb*64 .. +63) into out[0..63].
inline void int4_block(const QMat& m, int64_t nb, const QuantRow& x, float* out) {
  static const PairIndex idx;
  const uint8_t* base = m.packed + nb * BLOCK * m.K / 2;
  const bool next_block = (nb + 2) * BLOCK <= m.N;
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x.q.data());  // (xq[k], xq[k+1]) per int32
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512 sx = _mm512_set1_ps(x.sx);
  __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t G = m.K / m.group;
  for (int64_t g = 0; g < G; g++) {
    // Two sets of 4 chains, alternating k pairs (a group has an even number of pairs: 32/64/128 inputs).
    __m512i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k = g * m.group; k < (g + 1) * m.group; k += 4) {
      for (int h = 0; h < 2; h++) {
        _mm_prefetch(reinterpret_cast<const char*>(base + (k + 2 * h) * 32 + INT4_AHEAD), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(base + (k + 2 * h) * 32);  // k and k+1, 32 bytes each
        const __m512i lo = _mm512_and_si512(bytes, nib);                       // rows 0-31
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);  // rows 32-63
        const __m512i xv = _mm512_set1_epi32(xpairs[(k + 2 * h) / 2]);
        __m512i* a = acc + 4 * h;
        a[0] = _mm512_dpwssd_epi32(a[0], _mm512_maskz_permutexvar_epi8(EVEN_BYTES, idx.low, lo), xv);
        a[1] = _mm512_dpwssd_epi32(a[1], _mm512_maskz_permutexvar_epi8(EVEN_BYTES, idx.high, lo), xv);
        a[2] = _mm512_dpwssd_epi32(a[2], _mm512_maskz_permutexvar_epi8(EVEN_BYTES, idx.low, hi), xv);
        a[3] = _mm512_dpwssd_epi32(a[3], _mm512_maskz_permutexvar_epi8(EVEN_BYTES, idx.high, hi), xv);
      }
    }
    for (int i = 0; i < 4; i++) acc[i] = _mm512_add_epi32(acc[i], acc[i + 4]);
    const __m512i mid = _mm512_set1_epi32(8 * x.qsum[g]);
    const __m512 xs = _mm512_set1_ps(x.xsum[g]);
    if (next_block && !m.scales_f32)  // the next block's (scale, zero) of this group: 4 lines
      for (int i = 0; i < 4; i++)
        _mm_prefetch(reinterpret_cast<const char*>(static_cast<const bf16*>(m.scales) + (g * m.N + (nb + 1) * BLOCK) * 2) + 64 * i,
                     _MM_HINT_T0);
    for (int i = 0; i < 4; i++) {
      __m512 s, z;
      load_scale_zero(m, g, nb * BLOCK + 16 * i, s, z);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], mid));
      y[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, sx), dot, _mm512_fmadd_ps(z, xs, y[i]));
    }
  }
  for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + 16 * i, y[i]);
}

// One output row of the last, partial block (rows paired n, n+1 per byte, [K, rows/2]).
inline float int4_tail_row(const QMat& m, int64_t n, const QuantRow& x) {
  const int64_t full = m.N - m.N % BLOCK, rows = m.N - full, p = (n - full) / 2;
  const uint8_t* base = m.packed + full * m.K / 2;
  const int shift = (int)((n - full) % 2) * 4;
  float y = 0.0f;
  for (int64_t g = 0; g < m.K / m.group; g++) {
    int32_t acc = 0;
    for (int64_t k = g * m.group; k < (g + 1) * m.group; k++)
      acc += (int32_t)((base[k * (rows / 2) + p] >> shift) & 0xF) * x.q[k];
    const float s = m.scale_at((g * m.N + n) * 2), z = m.scale_at((g * m.N + n) * 2 + 1);
    y = std::fma(s * x.sx, (float)(acc - 8 * x.qsum[g]), std::fma(z, x.xsum[g], y));
  }
  return y;
}

// Rows [begin, end) of m x into out[0 .. end-begin). int4: begin/end on block bounds or in the tail.
inline void rows(const QMat& m, const QuantRow& x, int64_t begin, int64_t end, float* out) {
  if (m.group == 0) return int8_range(m, x, begin, end, out);
  const int64_t full = m.N - m.N % BLOCK;
  int64_t n = begin;
  for (; n + BLOCK <= std::min(end, full); n += BLOCK) int4_block(m, n / BLOCK, x, out + (n - begin));
  for (; n < end; n++) out[n - begin] = int4_tail_row(m, n, x);
}

// Work units of a matrix: int8 runs of 16 rows (the last one shorter), int4 whole blocks then
// tail rows.
constexpr int64_t INT8_UNIT = 16;
inline int64_t units(const QMat& m) { return m.group ? m.N / BLOCK + m.N % BLOCK : (m.N + INT8_UNIT - 1) / INT8_UNIT; }
inline int64_t unit_row(const QMat& m, int64_t u) {
  if (!m.group) return std::min(m.N, u * INT8_UNIT);
  const int64_t nb = m.N / BLOCK;
  return u < nb ? u * BLOCK : nb * BLOCK + (u - nb);
}
inline int64_t unit_grain(const QMat&) { return 1; }

// A raw matrix of the fused layer's address table (shapes checked by the caller once per layer).
inline QMat raw_mat(const void* codes, const void* scales, int64_t N, int64_t K, int64_t group, bool scales_f32) {
  QMat m;
  m.N = N;
  m.K = K;
  m.group = group;
  if (group)
    m.packed = static_cast<const uint8_t*>(codes);
  else
    m.codes = static_cast<const int8_t*>(codes);
  m.scales = scales;
  m.scales_f32 = scales_f32;
  return m;
}

// Scratch of quant_swiglu, kept by the caller across calls (no allocation per token once sized).
struct SwigluScratch {
  QuantRow xq;
  std::vector<QuantRow> hq;
  std::vector<float> g, u, h, y;
};

// SwiGLU of E quantized experts on one token x [H] (fp32, exact copies of the bf16/fp32 input):
// s.y [E, H] fp32, not yet rounded to the output dtype (the caller stores it). Expert e's matrices
// are gate[e], up[e] ([I, H]) and down[e] ([H, I]); bf: round as the bf16 torch ops would.
inline void quant_swiglu(const float* x, const QMat* gate, const QMat* up, const QMat* down, int64_t E, bool bf,
                         SwigluScratch& s) {
  const int64_t H = gate[0].K, I = gate[0].N, group = gate[0].group;
  s.xq.set(x, H, group);
  // Phase 1: h[e] = silu(gate x) * (up x), rounded like the bf16 torch ops it replaces.
  s.g.resize(E * I), s.u.resize(E * I), s.h.resize(E * I);
  float *g = s.g.data(), *u = s.u.data(), *h = s.h.data();
  const int64_t per = units(gate[0]);
  at::parallel_for(0, E * per, unit_grain(gate[0]), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
      const int64_t e = t / per, u0 = t % per;
      const int64_t n0 = unit_row(gate[e], u0), n1 = u0 + 1 < per ? unit_row(gate[e], u0 + 1) : I;
      rows(gate[e], s.xq, n0, n1, g + e * I + n0);
      rows(up[e], s.xq, n0, n1, u + e * I + n0);
      for (int64_t i = e * I + n0; i < e * I + n1; i++) {
        const float gv = bf ? round_bf16(g[i]) : g[i], uv = bf ? round_bf16(u[i]) : u[i];
        const float sl = gv / (1.0f + std::exp(-gv));
        h[i] = bf ? round_bf16(round_bf16(sl) * uv) : sl * uv;
      }
    }
  });
  // Phase 2: each expert's h quantized on its own, then its down rows.
  if ((int64_t)s.hq.size() < E) s.hq.resize(E);
  for (int64_t e = 0; e < E; e++) s.hq[e].set(h + e * I, I, group);
  s.y.resize(E * H);
  float* y = s.y.data();
  const int64_t per_down = units(down[0]);
  at::parallel_for(0, E * per_down, unit_grain(down[0]), [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
      const int64_t e = t / per_down, u0 = t % per_down;
      const int64_t n0 = unit_row(down[e], u0), n1 = u0 + 1 < per_down ? unit_row(down[e], u0 + 1) : H;
      rows(down[e], s.hq[e], n0, n1, y + e * H + n0);
    }
  });
}

}  // namespace colibri_int_kernels

COLIBRI_INT_TARGET_END
