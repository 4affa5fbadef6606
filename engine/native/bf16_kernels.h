// The bf16 decode kernels that several ops share: the AVX512-BF16 dot product and the SwiGLU of a
// set of experts on one token. Header-only (inline), included by bf16_decode.cpp (linear_bf16,
// experts_bf16) and moe_decode.cpp (the fused MoE layer), so an expert computed by either op is the
// same code, the same order of sums and the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "native_common.h"

namespace colibri_native {

inline __m512bh load32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_tail(const bf16* p, int64_t n) {  // n < 32 elements, the rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p);
}

// fp32 dot product of K bf16 elements: two accumulators over 32-element blocks, one horizontal sum.
// The reference order every kernel below keeps: dot4 and the row loops give these bits.
inline float dot(const bf16* w, const bf16* x, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, load32(w + k), load32(x + k));
    a1 = _mm512_dpbf16_ps(a1, load32(w + k + 32), load32(x + k + 32));
  }
  if (k + 32 <= K) {
    a0 = _mm512_dpbf16_ps(a0, load32(w + k), load32(x + k));
    k += 32;
  }
  if (k < K) a1 = _mm512_dpbf16_ps(a1, load_tail(w + k, K - k), load_tail(x + k, K - k));
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Bytes ahead of each weight stream to prefetch: a row is 1-2 KiB, so this reaches into the next
// row while the current one is summed (the hardware prefetcher follows one stream, not four).
constexpr int64_t PREFETCH_BYTES = 512;

// The horizontal sums of four vectors at once, each the same bits as _mm512_reduce_add_ps of it:
// GCC's reduction pairs lane i with i+8, then i+4, then i+2, then i+1; so does this, four rows per
// instruction (float addition is commutative, so the operand order within a pair does not matter).
inline __m128 reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  // lanes i + (i+8): rows 0,1 in one vector, rows 2,3 in the other (8 lanes each)
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  // lanes i + (i+4): one 128-bit lane per row
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  // i + (i+2), then i + (i+1), inside each 128-bit lane
  const __m512 s2 = _mm512_add_ps(s4, _mm512_permute_ps(s4, 0x4E));
  const __m512 s1 = _mm512_add_ps(s2, _mm512_permute_ps(s2, 0xB1));
  // lane 0 of each 128-bit lane: rows 0..3
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s1));
}

// Four rows against one x: out[r] is dot(w_r, x, K) bit for bit (each row's two accumulators see
// the same blocks in the same order), but the x loads are shared, four weight streams are in
// flight, and one combined reduction replaces four.
inline void dot4(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const bf16* x, int64_t K,
                 float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
  constexpr int64_t PF = PREFETCH_BYTES / 2;  // in elements
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + k + PF), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + k + PF), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w2 + k + PF), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w3 + k + PF), _MM_HINT_T0);
    const __m512bh x0 = load32(x + k), x1 = load32(x + k + 32);
    a0 = _mm512_dpbf16_ps(a0, load32(w0 + k), x0);
    a1 = _mm512_dpbf16_ps(a1, load32(w0 + k + 32), x1);
    b0 = _mm512_dpbf16_ps(b0, load32(w1 + k), x0);
    b1 = _mm512_dpbf16_ps(b1, load32(w1 + k + 32), x1);
    c0 = _mm512_dpbf16_ps(c0, load32(w2 + k), x0);
    c1 = _mm512_dpbf16_ps(c1, load32(w2 + k + 32), x1);
    d0 = _mm512_dpbf16_ps(d0, load32(w3 + k), x0);
    d1 = _mm512_dpbf16_ps(d1, load32(w3 + k + 32), x1);
  }
  if (k + 32 <= K) {
    const __m512bh x0 = load32(x + k);
    a0 = _mm512_dpbf16_ps(a0, load32(w0 + k), x0);
    b0 = _mm512_dpbf16_ps(b0, load32(w1 + k), x0);
    c0 = _mm512_dpbf16_ps(c0, load32(w2 + k), x0);
    d0 = _mm512_dpbf16_ps(d0, load32(w3 + k), x0);
    k += 32;
  }
  if (k < K) {
    const int64_t n = K - k;
    const __m512bh xt = load_tail(x + k, n);
    a1 = _mm512_dpbf16_ps(a1, load_tail(w0 + k, n), xt);
    b1 = _mm512_dpbf16_ps(b1, load_tail(w1 + k, n), xt);
    c1 = _mm512_dpbf16_ps(c1, load_tail(w2 + k, n), xt);
    d1 = _mm512_dpbf16_ps(d1, load_tail(w3 + k, n), xt);
  }
  _mm_storeu_ps(out, reduce4(_mm512_add_ps(a0, a1), _mm512_add_ps(b0, b1), _mm512_add_ps(c0, c1),
                             _mm512_add_ps(d0, d1)));
}

// Rows [begin, end) of a row-major W [N, K] against x: emit(n, dot) for each, four rows per pass,
// the last few one at a time; the bits of each dot are dot()'s, whatever the split.
template <class Emit>
inline void dot_rows(const bf16* w, int64_t K, const bf16* x, int64_t begin, int64_t end, Emit emit) {
  int64_t n = begin;
  float o[4];
  for (; n + 4 <= end; n += 4) {
    const bf16* r = w + n * K;
    dot4(r, r + K, r + 2 * K, r + 3 * K, x, K, o);
    for (int j = 0; j < 4; j++) emit(n + j, o[j]);
  }
  for (; n < end; n++) emit(n, dot(w + n * K, x, K));
}

// This thread's share [begin, end) of n items split over T threads, boundaries on multiples of
// `align` (the last share takes the rest): the static partition of the one-region kernels.
inline void thread_share(int64_t n, int64_t align, int t, int T, int64_t& begin, int64_t& end) {
  const int64_t units = (n + align - 1) / align;
  begin = std::min(n, units * t / T * align);
  end = std::min(n, units * (t + 1) / T * align);
}

inline const bf16* bf16_data(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, " must be bfloat16");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
  return reinterpret_cast<const bf16*>(t.data_ptr());
}

// One SwiGLU output from its gate and up dot products, rounded as the torch ops this replaces:
// gate and up products, silu, and their product each to bf16.
inline bf16 swiglu_value(float gate_dot, float up_dot) {
  const float g = round_bf16(gate_dot), u = round_bf16(up_dot);
  const float s = round_bf16(g / (1.0f + std::exp(-g)));
  return to_bf16(s * u);
}

// Gate/up work of E experts in units of two rows: unit u is rows i, i+1 (i = 2 (u % P)) of expert
// u / P, P = ceil(I / 2) units per expert; its two gate and two up rows run as one dot4, so h[e, i]
// and h[e, i+1] come from one pass. Units [u0, u1) of the E * P; h [E, I].
inline int64_t gate_up_units(int64_t I) { return (I + 1) / 2; }

inline void gate_up_rows(const bf16* x, const bf16* const* gate, const bf16* const* up, int64_t H, int64_t I,
                         int64_t u0, int64_t u1, bf16* h) {
  const int64_t P = gate_up_units(I);
  float o[4];
  for (int64_t u = u0; u < u1; u++) {
    const int64_t e = u / P, i = 2 * (u % P);
    const bf16* g = gate[e] + i * H;
    const bf16* p = up[e] + i * H;
    if (i + 1 < I) {
      dot4(g, g + H, p, p + H, x, H, o);
      h[e * I + i] = swiglu_value(o[0], o[2]);
      h[e * I + i + 1] = swiglu_value(o[1], o[3]);
    } else {
      h[e * I + i] = swiglu_value(dot(g, x, H), dot(p, x, H));
    }
  }
}

// SwiGLU of E experts on one token x [H]: h [E, I] scratch, y [E, H] out. Expert e's rows are
// gate[e], up[e] ([I, H] each) and down[e] ([H, I]). Each output element is one thread's, in one
// order, whatever E, the thread count or the split: an expert gives the same bits alone or batched
// (and as the fused MoE layer computes it, which calls the same row functions).
// One parallel region, one barrier (h complete before down reads it), a static split of the work.
inline void swiglu_experts(const bf16* x, const bf16* const* gate, const bf16* const* up,
                           const bf16* const* down, int64_t E, int64_t H, int64_t I, bf16* h, bf16* y) {
  const int64_t P = gate_up_units(I), Q = (H + 3) / 4;  // down: units of four rows of one expert
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    thread_share(E * P, 1, t, T, b, e);
    gate_up_rows(x, gate, up, H, I, b, e, h);
#pragma omp barrier
    thread_share(E * Q, 1, t, T, b, e);
    for (int64_t u = b; u < e; u++) {
      const int64_t ex = u / Q, n0 = 4 * (u % Q);
      bf16* ye = y + ex * H;
      dot_rows(down[ex], I, h + ex * I, n0, std::min(H, n0 + 4), [&](int64_t n, float v) { ye[n] = to_bf16(v); });
    }
  }
}

}  // namespace colibri_native
