// The bf16 decode kernels that several ops share: the AVX512-BF16 dot product and the SwiGLU of a
// set of experts on one token. Header-only (inline), included by bf16_decode.cpp (linear_bf16,
// experts_bf16) and moe_decode.cpp (the fused MoE layer), so an expert computed by either op is the
// same code, the same order of sums and the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "native_common.h"

namespace colibri_native {

inline __m512bh load32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_tail(const bf16* p, int64_t n) {  // n < 32 elements, the rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p);
}

// fp32 dot product of K bf16 elements: two accumulators over 32-element blocks, one horizontal sum.
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

inline const bf16* bf16_data(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, " must be bfloat16");
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
  return reinterpret_cast<const bf16*>(t.data_ptr());
}

// SwiGLU of E experts on one token x [H]: h [E, I] scratch, y [E, H] out. Expert e's rows are
// gate[e], up[e] ([I, H] each) and down[e] ([H, I]). Each output element is one thread's, in one
// order, whatever E, the thread count or the split: an expert gives the same bits alone or batched.
// Roundings as the torch ops this replaces: gate and up products, silu, and their product each to bf16.
inline void swiglu_experts(const bf16* x, const bf16* const* gate, const bf16* const* up,
                           const bf16* const* down, int64_t E, int64_t H, int64_t I, bf16* h, bf16* y) {
  // Gate row i and up row i of one expert make h[i]: no barrier between the two products.
  at::parallel_for(0, E * I, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const int64_t e = r / I, i = r % I;
      const float g = round_bf16(dot(gate[e] + i * H, x, H));
      const float u = round_bf16(dot(up[e] + i * H, x, H));
      const float s = round_bf16(g / (1.0f + std::exp(-g)));
      h[r] = to_bf16(s * u);
    }
  });
  at::parallel_for(0, E * H, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const int64_t e = r / H, n = r % H;
      y[r] = to_bf16(dot(down[e] + n * I, h + e * I, I));
    }
  });
}

}  // namespace colibri_native
