// The int8 (per-row scales) and int4 group-wise decode kernels, the SwiGLU of a set of quantized
// experts on one token, and that SwiGLU for a batched step's slots (rows routed to experts). Header-only (inline), included by int_decode.cpp (the separate ops)
// and moe_decode_int.cpp (the fused MoE layer), so an expert computed by either is the same code, the
// same order of sums and the same bits.
//
// Why native: torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` convert every weight to
// fp32 and multiply in fp32 (three vector instructions per 16 weights), which makes a decode token
// compute-bound on 2 cores.
//
// int8: the row x quantized once per call to int16 with one scale, sx = max|x| / 32767 (the error,
// <= max|x| / 65534 per element, is well under bf16's own rounding of x for all but the smallest
// elements), AVX512-VNNI vpdpwssd (32 products an instruction), exact int32 sums flushed to fp32
// per 2048 inputs:
//   y[n] = scale[n] * sx * sum_k q[n,k] xq[k]
//
// int4: the engine's strip layout (below; repacked from the stored layout as a matrix is read), x
// quantized to int8 per 32 inputs (scale sx_b = max|x_b| / 127, as llama.cpp's Q8_0 that its Q4_0
// decode multiplies by), vpdpbusd (64 products an instruction: unsigned codes x signed activations):
//   y[n] = sum over groups g of scale[g,n] * (sum over its 32-blocks b of sx_b * (sum_k c[n,k] q8[k] - 8 sum_k q8[k]))
//                            + zero[g,n] * sum_k x[k]          (k in g; c = code 0..15)
//
// Determinism: every output is computed by one thread in one fixed order whatever the thread
// count or the split, so an expert alone (streaming) and inside a batched or fused call (resident)
// give the same bits (the placement-invariance tests rely on it). Several activation rows against one
// matrix (prefill's rows_multi, a batched decode step's rows_slots) read each weight unit once for all
// rows, each row with its own sums in the one-row order: a row's outputs are the bits of a call with
// that row alone, so a sequence decodes the same in a batch as alone. Roundings of the SwiGLU follow
// experts_bf16 (bf16_kernels.h): gate and up products, silu and their product each rounded to the
// compute dtype (bf16 only).
//
// The VNNI/VBMI code (VBMI: the repack's byte permutes) is compiled for those instruction sets only
// (push/pop around it: the library is built for AVX512-BF16 CPUs, some of which lack VBMI); engine/native/__init__.py calls these
// ops only where /proc/cpuinfo lists both (INT_FLAGS). An includer puts its own ops that call them
// inside COLIBRI_INT_TARGET_BEGIN / END as well.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

#define COLIBRI_INT_TARGET_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx512vnni,avx512vbmi\")")
#define COLIBRI_INT_TARGET_END _Pragma("GCC pop_options")

COLIBRI_INT_TARGET_BEGIN

namespace colibri_int_kernels {

using namespace colibri_native;



constexpr float XQ_MAX = 32767.0f;
constexpr int64_t INT8_FLUSH = 2048;  // inputs per int32 partial: 2048/32 steps x 2 x 127 x 32767 < 2^31
constexpr int64_t BLOCK = 64;         // int4 rows per block of the stored layout


// One activation row, quantized. int8 weights (group 0): int16 codes (padded with zeros to a
// multiple of 64) and one scale. int4 (group > 0): int8 codes with one scale per 32 inputs, as
// llama.cpp's Q8_0 (vpdpbusd multiplies unsigned 4-bit codes by signed bytes), the sum of each
// 32-input block's codes (for the codes' offset of 8) and each weight group's sum of the real values
// (for the zeros).
struct QuantRow {
  std::vector<int16_t> q;  // int8 weights
  float sx = 0.0f;
  std::vector<int8_t> q8;  // int4 weights
  std::vector<float> sxb;
  std::vector<int32_t> qsum;
  std::vector<float> xsum;

  void set(const float* x, int64_t K, int64_t group) {
    if (group == 0) {
      float amax = 0.0f;
      for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
      sx = amax / XQ_MAX;
      const float inv = amax > 0.0f ? XQ_MAX / amax : 0.0f;
      q.assign((K + 63) / 64 * 64, 0);
      for (int64_t k = 0; k < K; k++) q[k] = (int16_t)std::nearbyint(x[k] * inv);
      return;
    }
    const int64_t B = K / 32, G = K / group;  // the group (32, 64 or 128) divides K
    q8.resize(K), sxb.resize(B), qsum.resize(B), xsum.assign(G, 0.0f);
    for (int64_t b = 0; b < B; b++) {
      const float* xb = x + 32 * b;
      float amax = 0.0f;
      for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xb[i]));
      sxb[b] = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t qs = 0;
      for (int i = 0; i < 32; i++) {
        const int8_t c = (int8_t)std::max(-127.0f, std::min(127.0f, std::nearbyint(xb[i] * inv)));
        q8[32 * b + i] = c;
        qs += c;
      }
      qsum[b] = qs;
    }
    for (int64_t g = 0; g < G; g++)
      for (int64_t k = g * group; k < (g + 1) * group; k++) xsum[g] += x[k];
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

// An int4 matrix in the strip layout (below): one uint8 tensor [N, K/2 + 4 K/g] holding codes and
// scales (int4_strips writes it from the stored pair); the stored scales_zeros argument is empty.
inline QMat int4_mat(const at::Tensor& strips, const at::Tensor& sz, int64_t group) {
  TORCH_CHECK(strips.scalar_type() == at::kByte && strips.dim() == 2,
              "int4 weights must be uint8 [N, K/2 + 4 K/group] in the strip layout (int4_strips)");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "int4 group must be 32, 64 or 128");
  TORCH_CHECK(sz.numel() == 0, "int4: the strip layout holds its scales; pass an empty scales_zeros");
  const int64_t N = strips.size(0), cols = strips.size(1), K = 2 * group * cols / (group + 8);
  TORCH_CHECK(K > 0 && K % group == 0 && K / 2 + 4 * (K / group) == cols,
              "int4: strip rows of ", cols, " bytes fit no K that the group ", group, " divides");
  check_cpu_contiguous(strips, "int4 strips");
  QMat m;
  m.N = N;
  m.K = K;
  m.group = group;
  m.packed = strips.data_ptr<uint8_t>();
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

// Row n of m against R activation rows (batched decode, R <= 4): out[r] = int8_row(m, n, *x[r]) bit
// for bit. Each 32-weight block is loaded and widened once for all R rows; row r keeps its own two
// chains and fp32 flush sum, in int8_row's order (its int32 sums are exact anyway), and the same
// final products: rows never share an accumulation.
template <int R>
inline void int8_row_multi(const QMat& m, int64_t n, const QuantRow* const* x, float* out) {
  const int8_t* w = m.codes + n * m.K;
  const int16_t* xq[R];
  __m512 accf[R];
  for (int r = 0; r < R; r++) xq[r] = x[r]->q.data(), accf[r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < m.K; k0 += INT8_FLUSH) {
    const int64_t k1 = std::min(m.K, k0 + INT8_FLUSH);
    __m512i a0[R], a1[R];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32)));
      for (int r = 0; r < R; r++) {
        a0[r] = _mm512_dpwssd_epi32(a0[r], w0, _mm512_loadu_si512(xq[r] + k));
        a1[r] = _mm512_dpwssd_epi32(a1[r], w1, _mm512_loadu_si512(xq[r] + k + 32));
      }
    }
    if (k + 32 <= k1) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
      for (int r = 0; r < R; r++) a0[r] = _mm512_dpwssd_epi32(a0[r], w0, _mm512_loadu_si512(xq[r] + k));
      k += 32;
    }
    if (k < k1) {
      const __mmask32 mask = (__mmask32)((1ull << (k1 - k)) - 1);
      const __m512i wt = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k));
      for (int r = 0; r < R; r++) a1[r] = _mm512_dpwssd_epi32(a1[r], wt, _mm512_loadu_si512(xq[r] + k));
    }
    for (int r = 0; r < R; r++) accf[r] = _mm512_add_ps(accf[r], _mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r])));
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(accf[r]) * x[r]->sx * m.scale_at(n);
}

// --- int4 ---------------------------------------------------------------------------------

// The int4 strip layout (engine/weights/quantized.py pack_int4_strips is the reference): rows in strips
// of 16, each strip one sequential run of G = K/g groups, a group = g/8 chunks of 64 codes bytes then
// the 16 rows' (scale, zero) bf16 pairs (64 bytes). Chunk c of a group covers inputs k0 .. k0+7
// (k0 = group start + 8c): byte 4r+j holds row r's code of k0+j (low nibble) and of k0+4+j (high),
// so one 64-byte load unpacks (an AND, a shift and an AND) into two registers whose 32-bit lane r
// is four consecutive codes of row r: vpdpbusd multiplies them by four broadcast int8 activations
// and sums into row r's lane, with no byte permutes. Rows past the last full strip (N % 16) follow,
// each K/2 bytes (low nibble = even k) then its G (scale, zero) pairs, computed by a scalar loop in
// the same order of sums (the same bits as if they sat in a strip).
//
// Why this layout (docs/BENCHMARKS.md, "int4 strips"): the stored 64-row layout needs four byte
// permutes and four vpdpwssd per 64 bytes, and its scales are a second stream 4 * N bytes apart per
// group; the kernel ran at ~19 GB/s from DRAM on one thread where bf16 reads ~29. The strips read
// one stream, and half the vector work per weight, at ~29 (1 thread) and ~37 (2 threads) against 27.
// The engine repacks the stored layout into this one as an expert is read (int4_strips below):
// stored files keep the layout torch's packed kernel reads (docs/FORMAT.md).

constexpr int64_t STRIP = 16;
constexpr int64_t XBLOCK = 32;  // int4 activations: int8 codes with one scale per 32 inputs (as Q8_0)

inline int64_t row_bytes(const QMat& m) { return m.K / 2 + 4 * (m.K / m.group); }
inline int64_t strip_bytes(const QMat& m) { return row_bytes(m) * STRIP; }

inline int32_t load4(const int8_t* p) {  // four activation bytes as one lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m512 bf16_pairs_low(__m512i d) { return _mm512_castsi512_ps(_mm512_slli_epi32(d, 16)); }
inline __m512 bf16_pairs_high(__m512i d) {
  return _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
}

// 16 outputs of full strip `s` (rows 16s .. 16s+15) into out[0..15].
inline void int4_strip(const QMat& m, int64_t s, const QuantRow& x, float* out) {
  const uint8_t* p = m.packed + s * strip_bytes(m);
  const int8_t* x8 = x.q8.data();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t G = m.K / m.group, blocks = m.group / XBLOCK;
  __m512 y = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t g = 0; g < G; g++) {
    __m512 f = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, k += XBLOCK) {
      // Four chains (two chunks x low/high nibbles): vpdpbusd's latency, not its throughput, bounds one.
      __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int c = 0; c < 4; c++, p += 64) {
        const __m512i bytes = _mm512_loadu_si512(p);
        const __m512i lo = _mm512_and_si512(bytes, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
        const int8_t* xk = x8 + k + 8 * c;
        a[2 * (c & 1)] = _mm512_dpbusd_epi32(a[2 * (c & 1)], lo, _mm512_set1_epi32(load4(xk)));
        a[2 * (c & 1) + 1] = _mm512_dpbusd_epi32(a[2 * (c & 1) + 1], hi, _mm512_set1_epi32(load4(xk + 4)));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(8 * x.qsum[k / XBLOCK])));
      const __m512 sx = _mm512_set1_ps(x.sxb[k / XBLOCK]);
      f = b == 0 ? _mm512_mul_ps(sx, dot) : _mm512_fmadd_ps(sx, dot, f);
    }
    const __m512i d = _mm512_loadu_si512(p);  // the strip's 16 (scale, zero) pairs of group g
    p += 64;
    y = _mm512_fmadd_ps(bf16_pairs_low(d), f, _mm512_fmadd_ps(bf16_pairs_high(d), _mm512_set1_ps(x.xsum[g]), y));
  }
  _mm512_storeu_ps(out, y);
}

// int4_strip for R activation rows at once (prefill): each 64-byte chunk is loaded and unpacked once
// and multiplied by every row's activations, so a chunk costs 3 + 2R vector ops, not 6R. A row's
// outputs are int4_strip's bits (its int32 sums are exact whatever the chains; the fp32 steps are
// the same, in the same order). Decode keeps int4_strip apart: this template at R = 1 (with
// int4_strip's four chains) ran demo int4-g32 scope-all decode at 0.86-0.99x of it, 7 of 7
// alternated rounds (decode_profile.py --before-src, 2026-12-05).
template <int R>
inline void int4_strip_rows(const QMat& m, int64_t s, const QuantRow* const* x, float* const* out) {
  const uint8_t* p = m.packed + s * strip_bytes(m);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t G = m.K / m.group, blocks = m.group / XBLOCK;
  __m512 y[R];
  const int8_t* xq[R];
  for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps(), xq[r] = x[r]->q8.data();
  int64_t k = 0;
  for (int64_t g = 0; g < G; g++) {
    __m512 f[R];
    for (int64_t b = 0; b < blocks; b++, k += XBLOCK) {
      __m512i a[R][2];
      for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
      for (int c = 0; c < 4; c++, p += 64) {
        const __m512i bytes = _mm512_loadu_si512(p);
        const __m512i lo = _mm512_and_si512(bytes, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
        for (int r = 0; r < R; r++) {
          const int8_t* xk = xq[r] + k + 8 * c;
          a[r][0] = _mm512_dpbusd_epi32(a[r][0], lo, _mm512_set1_epi32(load4(xk)));
          a[r][1] = _mm512_dpbusd_epi32(a[r][1], hi, _mm512_set1_epi32(load4(xk + 4)));
        }
      }
      for (int r = 0; r < R; r++) {
        const __m512i sum = _mm512_add_epi32(a[r][0], a[r][1]);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(8 * x[r]->qsum[k / XBLOCK])));
        const __m512 sx = _mm512_set1_ps(x[r]->sxb[k / XBLOCK]);
        f[r] = b == 0 ? _mm512_mul_ps(sx, dot) : _mm512_fmadd_ps(sx, dot, f[r]);
      }
    }
    const __m512i d = _mm512_loadu_si512(p);
    p += 64;
    const __m512 scale = bf16_pairs_low(d), zero = bf16_pairs_high(d);
    for (int r = 0; r < R; r++)
      y[r] = _mm512_fmadd_ps(scale, f[r], _mm512_fmadd_ps(zero, _mm512_set1_ps(x[r]->xsum[g]), y[r]));
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], y[r]);
}

// One row past the last full strip: the same sums in the same order, one lane's worth.
inline float int4_tail_row(const QMat& m, int64_t n, const QuantRow& x) {
  const int64_t full = m.N / STRIP * STRIP;
  const uint8_t* p = m.packed + full / STRIP * strip_bytes(m) + (n - full) * row_bytes(m);
  const bf16* sz = reinterpret_cast<const bf16*>(p + m.K / 2);
  const int64_t G = m.K / m.group, blocks = m.group / XBLOCK;
  float y = 0.0f;
  int64_t k = 0;
  for (int64_t g = 0; g < G; g++) {
    float f = 0.0f;
    for (int64_t b = 0; b < blocks; b++, k += XBLOCK) {
      int32_t acc = 0;
      for (int64_t i = k; i < k + XBLOCK; i++) acc += (int32_t)((p[i / 2] >> (4 * (i & 1))) & 0xF) * x.q8[i];
      const float dot = (float)(acc - 8 * x.qsum[k / XBLOCK]);
      f = b == 0 ? x.sxb[k / XBLOCK] * dot : std::fma(x.sxb[k / XBLOCK], dot, f);
    }
    y = std::fma(to_f32(sz[2 * g]), f, std::fma(to_f32(sz[2 * g + 1]), x.xsum[g], y));
  }
  return y;
}

// --- the stored int4 layout -> strips (once per matrix, as it is read) ------------------------

// Code (0..15) of row n, input k in the stored blocked layout (pack_int4): full 64-row blocks
// k-major (byte (k, j): row j low, row j+32 high), a last partial block [K, rows/2] (row pairs).
inline int stored_code(const uint8_t* packed, int64_t N, int64_t K, int64_t n, int64_t k) {
  const int64_t full = N - N % BLOCK;
  if (n < full) {
    const uint8_t byte = packed[(n / BLOCK) * BLOCK * K / 2 + k * 32 + (n % BLOCK) % 32];
    return (n % BLOCK) < 32 ? (byte & 0xF) : (byte >> 4);
  }
  const int64_t rows = N - full, r = n - full;
  const uint8_t byte = packed[full * K / 2 + k * (rows / 2) + r / 2];
  return r % 2 == 0 ? (byte & 0xF) : (byte >> 4);
}

// Whether every (scale, zero) bf16 pair has a finite scale > 0 and a finite zero, as quantize writes
// them (quant.py check_scales, which this replaces on the strips' path: a bad scale turns a row into
// NaN silently). On the bits: exponent all ones is Inf/NaN; a scale with the sign bit or no bits set is
// not > 0.
inline bool scales_ok(const uint32_t* pairs, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    const uint32_t s = pairs[i] & 0xffffu, z = pairs[i] >> 16;
    bad |= ((s & 0x7f80u) == 0x7f80u) | ((s & 0x8000u) != 0) | (s == 0) | ((z & 0x7f80u) == 0x7f80u);
  }
  return bad == 0;
}

// Writes the strips of a stored matrix (codes [N, K/2], scales_zeros bf16 [K/g, N, 2]) to out
// (N * (K/2 + 4 K/g) bytes), once its scales pass scales_ok (else false, out untouched). out may
// overlap the inputs: they are copied first.
inline bool repack_strips(const uint8_t* packed_in, const bf16* sz_in, int64_t N, int64_t K, int64_t group, uint8_t* out) {
  const int64_t G = K / group, codes_bytes = N * K / 2;
  if (!scales_ok(reinterpret_cast<const uint32_t*>(sz_in), G * N)) return false;
  static thread_local std::vector<uint8_t> copy;
  copy.resize(codes_bytes + G * N * 4);
  std::memcpy(copy.data(), packed_in, codes_bytes);
  std::memcpy(copy.data() + codes_bytes, sz_in, G * N * 4);
  const uint8_t* packed = copy.data();
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(copy.data() + codes_bytes);  // (scale, zero) pairs
  QMat m;
  m.N = N, m.K = K, m.group = group;
  const int64_t S = N / STRIP, full_blocks = N / BLOCK;
  // Byte-permute indices: for the 256 stored bytes of (block, k0 .. k0+7), strip q's chunk byte 4r+j
  // takes row 16q+r's byte of input k0+j (from the first 128 bytes) and of k0+4+j (the second 128).
  alignas(64) uint8_t idx[2][64];
  for (int q = 0; q < 2; q++)
    for (int r = 0; r < 16; r++)
      for (int j = 0; j < 4; j++) idx[q][4 * r + j] = (uint8_t)(j * 32 + 16 * q + r);
  const __m512i nib = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
  for (int64_t s = 0; s < S; s++) {
    uint8_t* o = out + s * strip_bytes(m);
    const int64_t nb = s * STRIP / BLOCK, q = (s * STRIP % BLOCK) / STRIP;
    for (int64_t g = 0; g < G; g++) {
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8, o += 64) {
        if (nb < full_blocks) {
          const uint8_t* src = packed + nb * BLOCK * K / 2 + k0 * 32;
          const __m512i ix = _mm512_load_si512(idx[q % 2]);
          const __m512i a = _mm512_permutex2var_epi8(_mm512_loadu_si512(src), ix, _mm512_loadu_si512(src + 64));
          const __m512i b = _mm512_permutex2var_epi8(_mm512_loadu_si512(src + 128), ix, _mm512_loadu_si512(src + 192));
          const __m512i v = q < 2 ? _mm512_or_si512(_mm512_and_si512(a, nib), _mm512_slli_epi16(_mm512_and_si512(b, nib), 4))
                                  : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nib), _mm512_and_si512(b, high));
          _mm512_storeu_si512(o, v);
        } else {
          for (int r = 0; r < 16; r++)
            for (int j = 0; j < 4; j++) {
              const int64_t n = s * STRIP + r;
              o[4 * r + j] = (uint8_t)(stored_code(packed, N, K, n, k0 + j) | (stored_code(packed, N, K, n, k0 + 4 + j) << 4));
            }
        }
      }
      std::memcpy(o, sz + g * N + s * STRIP, 64);
      o += 64;
    }
  }
  for (int64_t n = S * STRIP; n < N; n++) {
    uint8_t* o = out + S * strip_bytes(m) + (n - S * STRIP) * row_bytes(m);
    for (int64_t k = 0; k < K; k += 2)
      o[k / 2] = (uint8_t)(stored_code(packed, N, K, n, k) | (stored_code(packed, N, K, n, k + 1) << 4));
    uint32_t* pairs = reinterpret_cast<uint32_t*>(o + K / 2);
    for (int64_t g = 0; g < G; g++) std::memcpy(pairs + g, sz + g * N + n, 4);
  }
  return true;
}

// Rows [begin, end) of m x into out[0 .. end-begin). int4: begin/end on strip bounds or in the tail.
inline void rows(const QMat& m, const QuantRow& x, int64_t begin, int64_t end, float* out) {
  if (m.group == 0) return int8_range(m, x, begin, end, out);
  const int64_t full = m.N - m.N % STRIP;
  int64_t n = begin;
  for (; n + STRIP <= std::min(end, full); n += STRIP) int4_strip(m, n / STRIP, x, out + (n - begin));
  for (; n < end; n++) out[n - begin] = int4_tail_row(m, n, x);
}

// Rows [begin, end) of m against M activation rows: out[r] (row stride ldo) gets row r's outputs,
// the same bits as rows() of each alone. int4 strips take four activation rows a pass.
inline void rows_multi(const QMat& m, const QuantRow* x, int64_t M, int64_t begin, int64_t end, float* out, int64_t ldo) {
  int64_t r = 0;
  if (m.group) {
    const int64_t full = m.N - m.N % STRIP;
    for (; r + 4 <= M; r += 4) {
      const QuantRow* xs[4] = {&x[r], &x[r + 1], &x[r + 2], &x[r + 3]};
      int64_t n = begin;
      for (; n + STRIP <= std::min(end, full); n += STRIP) {
        float* outs[4] = {out + r * ldo + n, out + (r + 1) * ldo + n, out + (r + 2) * ldo + n, out + (r + 3) * ldo + n};
        int4_strip_rows<4>(m, n / STRIP, xs, outs);
      }
      for (; n < end; n++)
        for (int i = 0; i < 4; i++) out[(r + i) * ldo + n] = int4_tail_row(m, n, x[r + i]);
    }
  }
  for (; r < M; r++) rows(m, x[r], begin, end, out + r * ldo + begin);
}

// Rows [begin, end) of m against n activation rows given by address (a batched step's slots of one
// expert: rows of several sequences): out[j * ldo + row] gets x[j]'s outputs, the same bits as rows()
// of each alone. The weights are read once for all n: int8 one row at a time against four activation
// rows a pass (int8_row_multi), int4 one strip (a few KiB, in L1 across the passes) against four
// (int4_strip_rows); one activation row alone runs rows()' own kernels.
inline void rows_slots(const QMat& m, const QuantRow* const* x, int64_t nx, int64_t begin, int64_t end, float* out,
                       int64_t ldo) {
  if (nx == 1) return rows(m, *x[0], begin, end, out + begin);
  float o[4];
  if (m.group == 0) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t j = 0; j < nx; j += 4) {
        const int64_t c = std::min<int64_t>(4, nx - j);
        switch (c) {
          case 4: int8_row_multi<4>(m, n, x + j, o); break;
          case 3: int8_row_multi<3>(m, n, x + j, o); break;
          case 2: int8_row_multi<2>(m, n, x + j, o); break;
          default: o[0] = int8_row(m, n, *x[j]); break;
        }
        for (int64_t q = 0; q < c; q++) out[(j + q) * ldo + n] = o[q];
      }
    return;
  }
  const int64_t full = m.N - m.N % STRIP;
  int64_t n = begin;
  for (; n + STRIP <= std::min(end, full); n += STRIP)
    for (int64_t j = 0; j < nx; j += 4) {
      const int64_t c = std::min<int64_t>(4, nx - j);
      float* outs[4];
      for (int64_t q = 0; q < c; q++) outs[q] = out + (j + q) * ldo + n;
      switch (c) {
        case 4: int4_strip_rows<4>(m, n / STRIP, x + j, outs); break;
        case 3: int4_strip_rows<3>(m, n / STRIP, x + j, outs); break;
        case 2: int4_strip_rows<2>(m, n / STRIP, x + j, outs); break;
        default: int4_strip(m, n / STRIP, *x[j], outs[0]); break;
      }
    }
  for (; n < end; n++)
    for (int64_t j = 0; j < nx; j++) out[j * ldo + n] = int4_tail_row(m, n, *x[j]);
}

// Work units of a matrix: int8 runs of 16 rows (the last one shorter), int4 whole strips then
// tail rows.
constexpr int64_t INT8_UNIT = 16;
inline int64_t units(const QMat& m) { return m.group ? m.N / STRIP + m.N % STRIP : (m.N + INT8_UNIT - 1) / INT8_UNIT; }
inline int64_t unit_row(const QMat& m, int64_t u) {
  if (!m.group) return std::min(m.N, u * INT8_UNIT);
  const int64_t ns = m.N / STRIP;
  return u < ns ? u * STRIP : ns * STRIP + (u - ns);
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

// One SwiGLU output from the fp32 gate and up products; bf: rounded like the bf16 torch ops it
// replaces (the products, silu and their product each to bf16). quant_swiglu and quant_swiglu_slots
// share it, so an expert's h is the same bits in either.
inline float swiglu_value_q(float g, float u, bool bf) {
  const float gv = bf ? round_bf16(g) : g, uv = bf ? round_bf16(u) : u;
  const float sl = gv / (1.0f + std::exp(-gv));
  return bf ? round_bf16(round_bf16(sl) * uv) : sl * uv;
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
      for (int64_t i = e * I + n0; i < e * I + n1; i++) h[i] = swiglu_value_q(g[i], u[i], bf);
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

// quant_swiglu for a batched decode step: S slots, slot s applying one expert to one activation row
// (xs[s]: that row quantized as quant_swiglu quantizes x); the slots sorted by expert, A experts with
// slots: expert ex[a] (an index into gate, up, down) takes slots [first[a], first[a+1]). s.y [S, H]
// fp32 out, not yet rounded. Each unit of an expert's weights is read once for all its slots
// (rows_slots), each slot's h quantized on its own as quant_swiglu quantizes an expert's: slot s's
// outputs are quant_swiglu's bits for that row and that expert alone (slots never share a sum).
inline void quant_swiglu_slots(const QuantRow* const* xs, const QMat* gate, const QMat* up, const QMat* down,
                               const int64_t* ex, const int64_t* first, int64_t A, bool bf, SwigluScratch& s) {
  const int64_t S = first[A];
  if (S == 0) return;
  const int64_t H = gate[0].K, I = gate[0].N;
  s.g.resize(S * I), s.u.resize(S * I), s.h.resize(S * I);
  float *g = s.g.data(), *u = s.u.data(), *h = s.h.data();
  const int64_t per = units(gate[0]);
  at::parallel_for(0, A * per, unit_grain(gate[0]), [&](int64_t a0, int64_t a1) {
    for (int64_t t = a0; t < a1; t++) {
      const int64_t a = t / per, u0 = t % per, e = ex[a], s0 = first[a], n = first[a + 1] - s0;
      const int64_t n0 = unit_row(gate[e], u0), n1 = u0 + 1 < per ? unit_row(gate[e], u0 + 1) : I;
      rows_slots(gate[e], xs + s0, n, n0, n1, g + s0 * I, I);
      rows_slots(up[e], xs + s0, n, n0, n1, u + s0 * I, I);
      for (int64_t j = s0; j < s0 + n; j++)
        for (int64_t i = j * I + n0; i < j * I + n1; i++) h[i] = swiglu_value_q(g[i], u[i], bf);
    }
  });
  if ((int64_t)s.hq.size() < S) s.hq.resize(S);
  at::parallel_for(0, S, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) s.hq[j].set(h + j * I, I, gate[0].group);
  });
  std::vector<const QuantRow*> hq(S);
  for (int64_t j = 0; j < S; j++) hq[j] = &s.hq[j];
  s.y.resize(S * H);
  float* y = s.y.data();
  const int64_t per_down = units(down[0]);
  at::parallel_for(0, A * per_down, unit_grain(down[0]), [&](int64_t a0, int64_t a1) {
    for (int64_t t = a0; t < a1; t++) {
      const int64_t a = t / per_down, u0 = t % per_down, e = ex[a], s0 = first[a], n = first[a + 1] - s0;
      const int64_t n0 = unit_row(down[e], u0), n1 = u0 + 1 < per_down ? unit_row(down[e], u0 + 1) : H;
      rows_slots(down[e], hq.data() + s0, n, n0, n1, y + s0 * H, H);
    }
  });
}

}  // namespace colibri_int_kernels

COLIBRI_INT_TARGET_END
