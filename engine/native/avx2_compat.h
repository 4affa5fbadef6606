// The AVX-512 intrinsics the bf16 / FP8 / MXFP4 kernels use, for a CPU with AVX2 and FMA only (many
// desktop and laptop CPUs: AMD Zen 2/3, Intel's consumer cores since Alder Lake). The AVX2 build
// (engine/native/__init__.py) force-includes this header before every source; the AVX-512 build never
// sees it. A 512-bit vector is a pair of 256-bit halves, lo holding elements 0-7 (or bytes 0-31), and
// each intrinsic below does what Intel's pseudo-code says lane by lane, so the kernels compile
// unchanged and keep their own guarantees: every element goes through the same instructions wherever it
// sits, so a row's bits follow neither the rows beside it nor its place in a vector (the comments of
// bf16_kernels.h and attention_math.h), on this build as on the other.
//
// Why not torch's own ops on such a CPU: without AVX512-BF16, ATen's bf16 matmul is a scalar dot per
// output and every decode step goes through ~500 small ops; the kernels here take a whole decode step
// in one call. Bits differ from the AVX-512 build (its vdpbf16ps flushes denormals, these FMAs do
// not): the same engine on one machine gives one answer, as between torch and native.
//
// Masked loads and stores touch only the lanes their mask names (a tail must not read past its row);
// masks are whole-lane prefixes here, but the emulation honours any mask. The int8/int4 kernels
// (AVX512-VNNI, VBMI) are not built with this header.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace colibri_avx2 {

struct m512 {
  __m256 lo, hi;
};
struct m512d {
  __m256d lo, hi;
};
struct m512i {
  __m256i lo, hi;
};
struct m512bh {  // 32 bf16, two to a 32-bit lane: element 2j in the low half of lane j
  __m256i lo, hi;
  m512bh() = default;
  explicit m512bh(m512i v) : lo(v.lo), hi(v.hi) {}
};

// --- float arithmetic ----------------------------------------------------------------------------

inline m512 set1_ps(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline m512 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline m512 setr_ps(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7, float e8,
                    float e9, float e10, float e11, float e12, float e13, float e14, float e15) {
  return {_mm256_setr_ps(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_ps(e8, e9, e10, e11, e12, e13, e14, e15)};
}
inline m512 add_ps(m512 a, m512 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline m512 sub_ps(m512 a, m512 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline m512 mul_ps(m512 a, m512 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline m512 min_ps(m512 a, m512 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline m512 max_ps(m512 a, m512 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline m512 fmadd_ps(m512 a, m512 b, m512 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline m512 fnmadd_ps(m512 a, m512 b, m512 c) {  // c - a * b, one rounding
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline m512 roundscale_nearest(m512 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^n for integral n (vscalefps): as two exact power-of-two scalings, so a result that lands in
// the subnormals or overflows is rounded once, as vscalefps rounds it. |n| <= 254 here (exp's n).
inline __m256 scalef_half(__m256 a, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n);
  const __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, s1), s2);
}
inline m512 scalef_ps(m512 a, m512 n) { return {scalef_half(a.lo, n.lo), scalef_half(a.hi, n.hi)}; }

// Lanes 0-3 of a, then 4-7 of a, 0-3 of b, 4-7 of b: the horizontal adds below always in this order.
inline float reduce_add_ps(m512 v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);  // lane i + lane i+8
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// vdpbf16ps: lane j += a[2j+1] * b[2j+1], then += a[2j] * b[2j]. A bf16 widened to fp32 is its bits
// shifted up 16; the product of two is exact in fp32, so an FMA is the instruction's add.
inline __m256 dpbf16_half(__m256 acc, __m256i a, __m256i b) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  const __m256 a_odd = _mm256_castsi256_ps(_mm256_and_si256(a, high));
  const __m256 b_odd = _mm256_castsi256_ps(_mm256_and_si256(b, high));
  const __m256 a_even = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
  const __m256 b_even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  acc = _mm256_fmadd_ps(a_odd, b_odd, acc);
  return _mm256_fmadd_ps(a_even, b_even, acc);
}
inline m512 dpbf16_ps(m512 acc, m512bh a, m512bh b) {
  return {dpbf16_half(acc.lo, a.lo, b.lo), dpbf16_half(acc.hi, a.hi, b.hi)};
}

// --- loads and stores ----------------------------------------------------------------------------

inline __m256i lane_mask8(unsigned bits) {  // 8 lanes of all-ones where bit i of `bits` is set
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
inline m512 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu_ps(float* p, m512 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline m512 maskz_loadu_ps(unsigned k, const float* p) {  // vmaskmovps: masked-off lanes neither read nor faulted
  return {_mm256_maskload_ps(p, lane_mask8(k & 0xff)), _mm256_maskload_ps(p + 8, lane_mask8((k >> 8) & 0xff))};
}
inline void mask_storeu_ps(float* p, unsigned k, m512 v) {
  _mm256_maskstore_ps(p, lane_mask8(k & 0xff), v.lo);
  _mm256_maskstore_ps(p + 8, lane_mask8((k >> 8) & 0xff), v.hi);
}
inline m512i loadu_si512(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
// The 16-bit and 8-bit masked loads and stores have no AVX2 instruction: a full mask is a plain load or
// store, any other goes element by element through a buffer (the kernels' tails).
template <class T, int N>
inline void masked_copy(uint32_t k, const T* from, T* to) {  // element i where bit i of k is set
  for (int i = 0; i < N; i++)
    if ((k >> i) & 1u) to[i] = from[i];
}
inline m512i maskz_loadu_epi16(uint32_t k, const void* p) {  // 32 16-bit elements
  if (k == 0xffffffffu) return loadu_si512(p);
  alignas(32) uint16_t buf[32] = {0};
  masked_copy<uint16_t, 32>(k, static_cast<const uint16_t*>(p), buf);
  return loadu_si512(buf);
}
inline __m256i maskz_loadu_epi16_256(unsigned k, const void* p) {  // 16 16-bit elements
  if ((k & 0xffffu) == 0xffffu) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[16] = {0};
  masked_copy<uint16_t, 16>(k, static_cast<const uint16_t*>(p), buf);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline void mask_storeu_epi16_256(void* p, unsigned k, __m256i v) {
  if ((k & 0xffffu) == 0xffffu) return _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), v);
  masked_copy<uint16_t, 16>(k, buf, static_cast<uint16_t*>(p));
}
inline __m128i maskz_loadu_epi8_128(unsigned k, const void* p) {  // 16 bytes
  if ((k & 0xffffu) == 0xffffu) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  alignas(16) uint8_t buf[16] = {0};
  masked_copy<uint8_t, 16>(k, static_cast<const uint8_t*>(p), buf);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}

// --- integers, conversions, casts ----------------------------------------------------------------

inline m512i set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline m512i and_si512(m512i a, m512i b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline m512i or_si512(m512i a, m512i b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline m512i add_epi32(m512i a, m512i b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline m512i slli_epi32(m512i a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline m512i srli_epi32(m512i a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline m512i cvtepu16_epi32(__m256i v) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
inline m512i cvtepu8_epi32(__m128i v) {
  return {_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))};
}
inline m512i cvtepi8_epi32(__m128i v) {
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
inline m512 cvtepi32_ps(m512i v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline m512 castsi512_ps(m512i v) { return {_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)}; }
inline m512i castps_si512(m512 v) { return {_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)}; }
inline m512d castps_pd(m512 v) { return {_mm256_castps_pd(v.lo), _mm256_castps_pd(v.hi)}; }
inline m512 castpd_ps(m512d v) { return {_mm256_castpd_ps(v.lo), _mm256_castpd_ps(v.hi)}; }

inline unsigned mask_of(__m256i lo, __m256i hi) {  // one bit per 32-bit lane whose bits are all set
  return (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(lo)) |
         ((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(hi)) << 8);
}
inline uint16_t cmplt_epi32_mask(m512i a, m512i b) {
  return (uint16_t)mask_of(_mm256_cmpgt_epi32(b.lo, a.lo), _mm256_cmpgt_epi32(b.hi, a.hi));
}
inline uint16_t cmpeq_epi32_mask(m512i a, m512i b) {
  return (uint16_t)mask_of(_mm256_cmpeq_epi32(a.lo, b.lo), _mm256_cmpeq_epi32(a.hi, b.hi));
}
inline m512 mask_blend_ps(unsigned k, m512 a, m512 b) {  // lane i: b where bit i of k, else a
  return {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(lane_mask8(k & 0xff))),
          _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(lane_mask8((k >> 8) & 0xff)))};
}
// vcvtneps2bf16 of 16 floats → 16 bf16 (round to nearest even; NaN stays a quiet NaN)
inline __m256i cvtneps_pbh(m512 v) {
  auto half = [](__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, nan);
  };
  // packus works within 128-bit lanes: [lo0-3 hi0-3 | lo4-7 hi4-7], put back in element order
  const __m256i packed = _mm256_packus_epi32(half(v.lo), half(v.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

// --- shuffles ------------------------------------------------------------------------------------

inline m512 unpacklo_ps(m512 a, m512 b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
inline m512 unpackhi_ps(m512 a, m512 b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
inline m512d unpacklo_pd(m512d a, m512d b) { return {_mm256_unpacklo_pd(a.lo, b.lo), _mm256_unpacklo_pd(a.hi, b.hi)}; }
inline m512d unpackhi_pd(m512d a, m512d b) { return {_mm256_unpackhi_pd(a.lo, b.lo), _mm256_unpackhi_pd(a.hi, b.hi)}; }
inline __m128 lane128(m512 v, int i) {  // 128-bit lane i of 4
  switch (i & 3) {
    case 0: return _mm256_castps256_ps128(v.lo);
    case 1: return _mm256_extractf128_ps(v.lo, 1);
    case 2: return _mm256_castps256_ps128(v.hi);
    default: return _mm256_extractf128_ps(v.hi, 1);
  }
}
// vshuff32x4: 128-bit lanes a[imm0-1], a[imm2-3], b[imm4-5], b[imm6-7]
inline m512 shuffle_f32x4(m512 a, m512 b, int imm) {
  return {_mm256_set_m128(lane128(a, imm >> 2), lane128(a, imm)),
          _mm256_set_m128(lane128(b, imm >> 6), lane128(b, imm >> 4))};
}
// vpermps: lane i = v[idx[i] & 15]
inline m512 permutexvar_ps(m512i idx, m512 v) {
  auto half = [&](__m256i i) {
    const __m256 from_lo = _mm256_permutevar8x32_ps(v.lo, i), from_hi = _mm256_permutevar8x32_ps(v.hi, i);
    const __m256i upper = _mm256_slli_epi32(i, 28);  // bit 3 of the index into the sign bit
    return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(upper));
  };
  return {half(idx.lo), half(idx.hi)};
}

}  // namespace colibri_avx2

// The kernels' names, mapped. (GCC's immintrin.h declares the AVX-512 types and intrinsics whatever the
// target flags; included above, it is not read again, and the names below are the emulation's.)
#define __m512 colibri_avx2::m512
#define __m512d colibri_avx2::m512d
#define __m512i colibri_avx2::m512i
#define __m512bh colibri_avx2::m512bh
#define _mm512_set1_ps colibri_avx2::set1_ps
#define _mm512_setzero_ps colibri_avx2::setzero_ps
#define _mm512_setr_ps colibri_avx2::setr_ps
#define _mm512_add_ps colibri_avx2::add_ps
#define _mm512_sub_ps colibri_avx2::sub_ps
#define _mm512_mul_ps colibri_avx2::mul_ps
#define _mm512_min_ps colibri_avx2::min_ps
#define _mm512_max_ps colibri_avx2::max_ps
#define _mm512_fmadd_ps colibri_avx2::fmadd_ps
#define _mm512_fnmadd_ps colibri_avx2::fnmadd_ps
#define _mm512_roundscale_ps(a, imm) colibri_avx2::roundscale_nearest(a)
#define _mm512_scalef_ps colibri_avx2::scalef_ps
#define _mm512_reduce_add_ps colibri_avx2::reduce_add_ps
#define _mm512_dpbf16_ps colibri_avx2::dpbf16_ps
#define _mm512_loadu_ps colibri_avx2::loadu_ps
#define _mm512_storeu_ps colibri_avx2::storeu_ps
#define _mm512_maskz_loadu_ps colibri_avx2::maskz_loadu_ps
#define _mm512_mask_storeu_ps colibri_avx2::mask_storeu_ps
#define _mm512_loadu_si512 colibri_avx2::loadu_si512
#define _mm512_maskz_loadu_epi16 colibri_avx2::maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 colibri_avx2::maskz_loadu_epi16_256
#define _mm256_mask_storeu_epi16 colibri_avx2::mask_storeu_epi16_256
#define _mm_maskz_loadu_epi8 colibri_avx2::maskz_loadu_epi8_128
#define _mm512_set1_epi32 colibri_avx2::set1_epi32
#define _mm512_and_si512 colibri_avx2::and_si512
#define _mm512_or_si512 colibri_avx2::or_si512
#define _mm512_add_epi32 colibri_avx2::add_epi32
#define _mm512_slli_epi32 colibri_avx2::slli_epi32
#define _mm512_srli_epi32 colibri_avx2::srli_epi32
#define _mm512_cvtepu16_epi32 colibri_avx2::cvtepu16_epi32
#define _mm512_cvtepu8_epi32 colibri_avx2::cvtepu8_epi32
#define _mm512_cvtepi8_epi32 colibri_avx2::cvtepi8_epi32
#define _mm512_cvtepi32_ps colibri_avx2::cvtepi32_ps
#define _mm512_castsi512_ps colibri_avx2::castsi512_ps
#define _mm512_castps_si512 colibri_avx2::castps_si512
#define _mm512_castps_pd colibri_avx2::castps_pd
#define _mm512_castpd_ps colibri_avx2::castpd_ps
#define _mm512_cmplt_epi32_mask colibri_avx2::cmplt_epi32_mask
#define _mm512_cmpeq_epi32_mask colibri_avx2::cmpeq_epi32_mask
#define _mm512_mask_blend_ps colibri_avx2::mask_blend_ps
#define _mm512_cvtneps_pbh colibri_avx2::cvtneps_pbh
#define _mm512_unpacklo_ps colibri_avx2::unpacklo_ps
#define _mm512_unpackhi_ps colibri_avx2::unpackhi_ps
#define _mm512_unpacklo_pd colibri_avx2::unpacklo_pd
#define _mm512_unpackhi_pd colibri_avx2::unpackhi_pd
#define _mm512_shuffle_f32x4 colibri_avx2::shuffle_f32x4
#define _mm512_permutexvar_ps colibri_avx2::permutexvar_ps
