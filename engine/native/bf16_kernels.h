// The bf16 decode kernels that several ops share: the AVX512-BF16 dot product (of one activation
// row, or of several against one weight row: batched decode), the SwiGLU of a set of experts on one
// token, and the SwiGLU of a batched step's experts on the rows routed to each. Header-only
// (inline), included by bf16_decode.cpp (linear_bf16, experts_bf16, experts_rows_bf16) and
// moe_decode.cpp (the fused MoE layer), so an expert computed by either op is the same code, the
// same order of sums and the same bits.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "native_common.h"

namespace colibri_native {

inline __m512bh load32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_tail(const bf16* p, int64_t n) {  // n < 32 elements, the rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p);
}

// fp32 dot product of K bf16 elements: two accumulators over 32-element blocks, one horizontal sum.
// Always inlined: a few instructions for K = 256, where a call per output (dot_many's one-row case,
// left out of line by the compiler) measured ~25% of a small model's batched MoE layer.
__attribute__((always_inline)) inline float dot(const bf16* w, const bf16* x, int64_t K) {
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

// Rows [begin, end) of a row-major W [N, K] against x: emit(n, dot) for each, one row after the
// other. One row per pass on purpose: four rows per pass sharing the x loads (with or without
// software prefetch) measured no faster and often slower on this machine class, because the weight
// stream is then four interleaved 1-2 KiB streams where the hardware prefetcher follows one
// sequential stream best (docs/BENCHMARKS.md, "bf16kern"); the kernel already runs at the
// memory's read bandwidth.
template <class Emit>
inline void dot_rows(const bf16* w, int64_t K, const bf16* x, int64_t begin, int64_t end, Emit emit) {
  for (int64_t n = begin; n < end; n++) emit(n, dot(w + n * K, x, K));
}

// One weight row w [K] against R activation rows x[0..R) (R <= 4): out[r] = dot(w, x[r], K) bit for
// bit. Why: batched decode (several sequences in one step, or a speculative verify's k+1 positions)
// dots each weight row with every row routed to it; here each 32-weight block is loaded once into a
// register for all R rows, so the weights stream from memory once per call, not once per row. Rows
// never share an accumulation: row r has its own two accumulators, fed the same blocks in the same
// order as dot() feeds its pair, and the same horizontal sum, so every output is dot()'s bits. (One
// weight stream still: not the several weight rows per pass that dot_rows declines above.)
template <int R>
inline void dot_multi(const bf16* w, const bf16* const* x, int64_t K, float* out) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = load32(w + k), w1 = load32(w + k + 32);
    for (int r = 0; r < R; r++) {
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, load32(x[r] + k));
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, load32(x[r] + k + 32));
    }
  }
  if (k + 32 <= K) {
    const __m512bh w0 = load32(w + k);
    for (int r = 0; r < R; r++) a0[r] = _mm512_dpbf16_ps(a0[r], w0, load32(x[r] + k));
    k += 32;
  }
  if (k < K) {
    const __m512bh wt = load_tail(w + k, K - k);
    for (int r = 0; r < R; r++) a1[r] = _mm512_dpbf16_ps(a1[r], wt, load_tail(x[r] + k, K - k));
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// One weight row against any number n of activation rows: out[j] = dot(w, x[j], K), four rows a pass
// (dot_multi), one row alone by dot() itself. The row stays in L1 between passes.
inline void dot_many(const bf16* w, const bf16* const* x, int64_t n, int64_t K, float* out) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dot_multi<4>(w, x + j, K, out + j);
  switch (n - j) {
    case 3: dot_multi<3>(w, x + j, K, out + j); break;
    case 2: dot_multi<2>(w, x + j, K, out + j); break;
    case 1: out[j] = dot(w, x[j], K); break;
    default: break;
  }
}

// Two weight rows w and v [K] against R activation rows x[0..R) (R <= 4): ow[r] = dot(w, x[r], K) and
// ov[r] = dot(v, x[r], K), bit for bit. Why: with several rows, dot_multi's inner loop loads ten vectors
// (two weight blocks, two of each of four rows) for eight vdpbf16ps and is bound by the loads, and at
// K = 256 an accumulator sees only four chained vdpbf16ps; two weight rows share the rows' loads
// (twelve for sixteen) and double the independent chains. The experts of a 9-row verify of the small
// reference model (36 slots over 15 experts, 128 KiB matrices): 1.2x faster (docs/BENCHMARKS.md, "Two
// weight rows a pass"). Each output keeps its own pair of accumulators, fed as dot() feeds its pair:
// dot()'s bits, whichever row it is paired with.
template <int R>
inline void dot_multi2(const bf16* w, const bf16* v, const bf16* const* x, int64_t K, float* ow, float* ov) {
  __m512 a0[R], a1[R], b0[R], b1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = b0[r] = b1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = load32(w + k), w1 = load32(w + k + 32), v0 = load32(v + k), v1 = load32(v + k + 32);
    for (int r = 0; r < R; r++) {
      const __m512bh x0 = load32(x[r] + k), x1 = load32(x[r] + k + 32);
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, x0);
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, x1);
      b0[r] = _mm512_dpbf16_ps(b0[r], v0, x0);
      b1[r] = _mm512_dpbf16_ps(b1[r], v1, x1);
    }
  }
  if (k + 32 <= K) {
    const __m512bh w0 = load32(w + k), v0 = load32(v + k);
    for (int r = 0; r < R; r++) {
      const __m512bh x0 = load32(x[r] + k);
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, x0);
      b0[r] = _mm512_dpbf16_ps(b0[r], v0, x0);
    }
    k += 32;
  }
  if (k < K) {
    const __m512bh wt = load_tail(w + k, K - k), vt = load_tail(v + k, K - k);
    for (int r = 0; r < R; r++) {
      const __m512bh xt = load_tail(x[r] + k, K - k);
      a1[r] = _mm512_dpbf16_ps(a1[r], wt, xt);
      b1[r] = _mm512_dpbf16_ps(b1[r], vt, xt);
    }
  }
  for (int r = 0; r < R; r++) {
    ow[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    ov[r] = _mm512_reduce_add_ps(_mm512_add_ps(b0[r], b1[r]));
  }
}

// Where a pass takes two weight rows: a matrix of at most PAIR_MAX_BYTES (a small model's experts and
// projections, which stay in the caches between calls), on the AVX-512 build. Why not a larger one: a
// matrix that streams from DRAM reads fastest as one sequential stream (dot_rows' note above), and two
// rows a pass (a trial build) made the batched calls of rows_kernels.py's 1 MiB experts and 64 MiB
// lm_head 1.1-1.7x slower. Why not the AVX2 build: its 512-bit vectors are pairs of its 16 registers,
// already short for dot_multi<4>'s eight accumulators.
constexpr int64_t PAIR_MAX_BYTES = 256 << 10;
inline bool pair_rows(int64_t rows, int64_t K) {
#if defined(__AVX512F__)
  return rows * K * (int64_t)sizeof(bf16) <= PAIR_MAX_BYTES;
#else
  (void)rows, (void)K;
  return false;
#endif
}

// Two weight rows against any number n of activation rows: ow[j] = dot(w, x[j], K), ov[j] = dot(v, x[j],
// K), four rows a pass (dot_multi2) where `pair` (pair_rows of their matrices), else one weight row
// a pass (dot_many, twice).
inline void dot_many2(const bf16* w, const bf16* v, const bf16* const* x, int64_t n, int64_t K, float* ow,
                      float* ov, bool pair) {
  if (!pair) {
    dot_many(w, x, n, K, ow);
    dot_many(v, x, n, K, ov);
    return;
  }
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) dot_multi2<4>(w, v, x + j, K, ow + j, ov + j);
  switch (n - j) {
    case 3: dot_multi2<3>(w, v, x + j, K, ow + j, ov + j); break;
    case 2: dot_multi2<2>(w, v, x + j, K, ow + j, ov + j); break;
    case 1: dot_multi2<1>(w, v, x + j, K, ow + j, ov + j); break;
    default: break;
  }
}

// Weight rows [begin, end) of a row-major W [N, K] against B activation rows x[0..B): emit(r, n, dot)
// for every pair, each weight row read once for all B rows (up to four in registers a pass); two
// weight rows a pass where pair_rows(N, K) (dot_many2), the odd one last alone. Every output is dot()'s
// bits. The batched paths' loop (linear_bf16, the attention's projections, the experts' down rows, the
// routers); one activation row takes dot_rows' single stream instead.
template <class Emit>
inline void dot_rows_many(const bf16* w, int64_t N, int64_t K, const bf16* const* x, int64_t B, int64_t begin,
                          int64_t end, Emit emit) {
  float o0[4], o1[4];
  int64_t n = begin;
  if (pair_rows(N, K))
    for (; n + 2 <= end; n += 2)
      for (int64_t r = 0; r < B; r += 4) {
        const int64_t c = std::min<int64_t>(4, B - r);
        dot_many2(w + n * K, w + (n + 1) * K, x + r, c, K, o0, o1, true);
        for (int64_t j = 0; j < c; j++) emit(r + j, n, o0[j]), emit(r + j, n + 1, o1[j]);
      }
  for (; n < end; n++)
    for (int64_t r = 0; r < B; r += 4) {
      const int64_t c = std::min<int64_t>(4, B - r);
      dot_many(w + n * K, x + r, c, K, o0);
      for (int64_t j = 0; j < c; j++) emit(r + j, n, o0[j]);
    }
}

// This thread's share [begin, end) of n items split over T threads: the static partition of the
// one-region kernels (each thread's rows one contiguous stream).
inline void thread_share(int64_t n, int t, int T, int64_t& begin, int64_t& end) {
  begin = n * t / T;
  end = n * (t + 1) / T;
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

// Gate/up rows [r0, r1) of E experts (row r: row r % I of expert r / I), each expert's gate and up
// rows streamed in order: h[r] = silu(gate . x) * (up . x), h [E, I].
inline void gate_up_rows(const bf16* x, const bf16* const* gate, const bf16* const* up, int64_t H, int64_t I,
                         int64_t r0, int64_t r1, bf16* h) {
  for (int64_t r = r0; r < r1; r++) {
    const int64_t e = r / I, i = r % I;
    h[r] = swiglu_value(dot(gate[e] + i * H, x, H), dot(up[e] + i * H, x, H));
  }
}

// SwiGLU of E experts on one token x [H]: h [E, I] scratch, y [E, H] out. Expert e's rows are
// gate[e], up[e] ([I, H] each) and down[e] ([H, I]). Each output element is one thread's, in one
// order, whatever E, the thread count or the split: an expert gives the same bits alone or batched
// (and as the fused MoE layer computes it, which calls the same row functions).
// Two at::parallel_for loops, as before bf16kern: this is the streaming path's per-expert op (one
// call per expert as its read lands), and the tree that ran it as one OpenMP region with a barrier
// measured 0.52x cold streaming tok/s against main (docs/BENCHMARKS.md, "bf16kern"); the resident
// paths (moe_bf16.h, decode_step.cpp) keep their one region.
inline void swiglu_experts(const bf16* x, const bf16* const* gate, const bf16* const* up,
                           const bf16* const* down, int64_t E, int64_t H, int64_t I, bf16* h, bf16* y) {
  at::parallel_for(0, E * I, GRAIN, [&](int64_t b, int64_t e) { gate_up_rows(x, gate, up, H, I, b, e, h); });
  at::parallel_for(0, E * H, GRAIN, [&](int64_t b, int64_t e) {  // expert-major: each expert's down rows one stream
    for (int64_t r = b; r < e; r++) y[r] = to_bf16(dot(down[r / H] + (r % H) * I, h + (r / H) * I, I));
  });
}

// The experts of a batched decode step: S slots, slot s applying one expert to one activation row
// (xs[s], [H]); the slots sorted by expert, A experts with slots: expert ex[a] (an index into gate, up,
// down) takes slots [first[a], first[a+1]). h [S, I] scratch, y [S, H] out. Each weight row of an
// expert (gate/up row i, down row n) is read once for all its slots (dot_many: the row in registers
// for four slots at a time), so a step reads each expert once whatever the rows it serves. Every
// value is swiglu_experts' for that slot's row alone (the same dot() bits, the same roundings: a slot
// never shares an accumulation with another), so a sequence decodes the same bits in a batch as
// alone. Parallel over the experts' weight rows as swiglu_experts (two at::parallel_for loops).
inline void swiglu_slots(const bf16* const* xs, const bf16* const* gate, const bf16* const* up,
                         const bf16* const* down, const int64_t* ex, const int64_t* first, int64_t A, int64_t H,
                         int64_t I, bf16* h, bf16* y) {
  const bool pair = pair_rows(I, H);  // the gate and up matrices [I, H]
  at::parallel_for(0, A * I, GRAIN, [&](int64_t b, int64_t e) {
    float gd[4], ud[4];
    for (int64_t r = b; r < e; r++) {
      const int64_t a = r / I, i = r % I, s0 = first[a], s1 = first[a + 1];
      const bf16 *g = gate[ex[a]] + i * H, *u = up[ex[a]] + i * H;
      for (int64_t s = s0; s < s1; s += 4) {
        const int64_t n = std::min<int64_t>(4, s1 - s);
        dot_many2(g, u, xs + s, n, H, gd, ud, pair);  // the gate and up rows side by side
        for (int64_t j = 0; j < n; j++) h[(s + j) * I + i] = swiglu_value(gd[j], ud[j]);
      }
    }
  });
  std::vector<const bf16*> hs(first[A]);  // each slot's h row, for the down rows' dot_rows_many
  for (int64_t s = 0; s < first[A]; s++) hs[s] = h + s * I;
  at::parallel_for(0, A * H, GRAIN, [&](int64_t b, int64_t e) {  // expert-major: each expert's down rows in order
    for (int64_t r = b; r < e;) {  // this share's part of each expert: its down rows [n0, n1), all its slots
      const int64_t a = r / H, n0 = r % H, n1 = std::min(H, n0 + (e - r)), s0 = first[a], s1 = first[a + 1];
      dot_rows_many(down[ex[a]], H, I, hs.data() + s0, s1 - s0, n0, n1,
                    [&](int64_t j, int64_t n, float v) { y[(s0 + j) * H + n] = to_bf16(v); });
      r += n1 - n0;
    }
  });
}

}  // namespace colibri_native
