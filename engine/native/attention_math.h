// The heads loop's vector arithmetic (attention_kernels.h attention_batch): a query head's scores over
// a block of cache rows, the softmax's exp, and the P.V sum. Each value is computed by the same
// instructions whatever its place in a vector or a block, so a row's attention has the same bits in
// a call of one row (decode) or many (a batched step, a speculative verify).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_kernels.h"

namespace colibri_native {

// Scores of `rows` cache rows (bf16 [rows, D]) against one query head q [D]: out[j] = k_j . q in fp32.
// Sixteen keys at a time, each key's dot in its own 16 fp32 lanes (vdpbf16ps over D), then one
// transposing tree of adds turns the sixteen vectors into one vector of sixteen sums. Why: a
// horizontal sum per key (_mm512_reduce_add_ps) was most of the heads loop at a long context. Each
// key's lanes go through the same adds whichever of the sixteen it is and however many there are
// (missing keys are zero vectors), so a score depends on its key and q alone: a row's bits do not
// follow its position in a block, the block's length or the rows beside it.
inline void qk_scores(const bf16* keys, int64_t rows, int64_t D, const bf16* q, float* out) {
  __m512 acc[16];
  for (int64_t j0 = 0; j0 < rows; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - j0);
    for (int64_t t = 0; t < 16; t++) {
      __m512 a = _mm512_setzero_ps();
      if (t < n) {
        const bf16* k = keys + (j0 + t) * D;
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) a = _mm512_dpbf16_ps(a, load32(k + d), load32(q + d));
        if (d < D) a = _mm512_dpbf16_ps(a, load_tail(k + d, D - d), load_tail(q + d, D - d));
      }
      acc[t] = a;
    }
    __m512 u[8], w[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      u[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]), _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // per 128-bit lane: four keys' sums over that lane
      const __m512d x = _mm512_castps_pd(u[2 * i]), y = _mm512_castps_pd(u[2 * i + 1]);
      w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // across the four 128-bit lanes: w[i] holds keys 4i..4i+3 in each lane
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
    _mm512_mask_storeu_ps(out + j0, (__mmask16)((1u << n) - 1), sums);
  }
}

// acc [D] += sum over j < rows of p[j] * v_j (v bf16 [rows, D]), each element summed over j in order,
// one fused multiply-add per term (what the scalar loop compiles to): the accumulator in registers
// for D a multiple of 16 up to 256, else that scalar loop.
inline void pv_accumulate(const bf16* values, int64_t rows, int64_t D, const float* p, const float* scales, float* acc) {
  if (D % 16 == 0 && D <= 256) {
    __m512 a[16];
    const int64_t V = D / 16;
    for (int64_t i = 0; i < V; i++) a[i] = _mm512_loadu_ps(acc + 16 * i);
    for (int64_t j = 0; j < rows; j++) {
      const __m512 w = _mm512_set1_ps(scales ? p[j] * scales[j] : p[j]);
      const bf16* v = values + j * D;
      for (int64_t i = 0; i < V; i++) {
        const __m512 x = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v + 16 * i))), 16));
        a[i] = _mm512_fmadd_ps(w, x, a[i]);
      }
    }
    for (int64_t i = 0; i < V; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
    return;
  }
  for (int64_t j = 0; j < rows; j++) {
    const bf16* vr = values + j * D;
    const float w = scales ? p[j] * scales[j] : p[j];  // codes: the row's scale folded into its weight
    for (int64_t i = 0; i < D; i++) acc[i] += w * to_f32(vr[i]);
  }
}

// p[j] = exp(p[j] - m) for j < S, in AVX512 lanes: Cephes' expf (2^n times a degree-6 polynomial of
// the remainder, ~1 ulp), the tail in a masked vector. Why: std::exp one score at a time, S of them
// per head per row, was ~15% of a layer's attention at position 600 (a 9-row verify's 0.73 -> 0.62 ms,
// one row's 0.114 -> 0.101 ms, docs/BENCHMARKS.md). Every element goes through the same instructions
// wherever it sits (a full vector or the masked tail), so a score's value depends on itself alone:
// a row's bits do not follow S's alignment or the rows beside it.
inline void exp_minus_max(float* p, int64_t S, float m) {
  const __m512 mx = _mm512_set1_ps(m), hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), c1 = _mm512_set1_ps(0.693359375f),
               c2 = _mm512_set1_ps(-2.12194440e-4f);
  const __m512 p0 = _mm512_set1_ps(1.9875691500e-4f), p1 = _mm512_set1_ps(1.3981999507e-3f),
               p2 = _mm512_set1_ps(8.3334519073e-3f), p3 = _mm512_set1_ps(4.1665795894e-2f),
               p4 = _mm512_set1_ps(1.6666665459e-1f), p5 = _mm512_set1_ps(5.0000001201e-1f), one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < S; j += 16) {
    const __mmask16 k = S - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (S - j)) - 1);
    __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), mx);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, c1, x);  // x - n ln2, ln2 in two parts
    x = _mm512_fnmadd_ps(n, c2, x);
    __m512 y = _mm512_fmadd_ps(p0, x, p1);
    y = _mm512_fmadd_ps(y, x, p2);
    y = _mm512_fmadd_ps(y, x, p3);
    y = _mm512_fmadd_ps(y, x, p4);
    y = _mm512_fmadd_ps(y, x, p5);
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, one));
    _mm512_mask_storeu_ps(p + j, k, _mm512_scalef_ps(y, n));
  }
}

}  // namespace colibri_native
