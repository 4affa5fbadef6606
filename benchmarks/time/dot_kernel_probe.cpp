// The bf16 dot kernel's inner loop outside the engine: which way of walking the weight rows streams
// fastest from DRAM on this machine (docs/BENCHMARKS.md, "bf16kern"). 400 MB of [N, K] bf16 rows,
// K from the command line, every thread (OMP_NUM_THREADS) one contiguous share, best of 8 passes:
//   mode 0  one row per pass (engine/native/bf16_kernels.h dot: what the engine runs)
//   mode 1  four adjacent rows per pass sharing the x loads
//   mode 2  the same with software prefetch 512 elements ahead; 3: 1024; 4: 256
//   mode 6  four rows from four far-apart sub-ranges (four long sequential streams); 7: with prefetch
//   mode 5  plain reads of the same bytes (xor of vectors): the memory's read bandwidth
// Every result feeds a sink the compiler cannot drop. Build and run:
//   g++ -O3 -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512bf16 benchmarks/time/dot_kernel_probe.cpp -o dot_kernel_probe
//   for m in 5 0 1 2 6 7; do OMP_NUM_THREADS=2 ./dot_kernel_probe 1024 $m; done
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
typedef uint16_t bf16;
static inline __m512bh load32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline float dot1(const bf16* w, const bf16* x, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, load32(w + k), load32(x + k));
    a1 = _mm512_dpbf16_ps(a1, load32(w + k + 32), load32(x + k + 32));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
template <int PF>
static inline void dot4p(const bf16* w0, const bf16* w1, const bf16* w2, const bf16* w3, const bf16* x, int64_t K, float* out) {
  __m512 a[8];
  for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k + 64 <= K; k += 64) {
    if (PF) { _mm_prefetch((const char*)(w0 + k + PF), _MM_HINT_T0); _mm_prefetch((const char*)(w1 + k + PF), _MM_HINT_T0);
              _mm_prefetch((const char*)(w2 + k + PF), _MM_HINT_T0); _mm_prefetch((const char*)(w3 + k + PF), _MM_HINT_T0); }
    __m512bh x0 = load32(x + k), x1 = load32(x + k + 32);
    a[0] = _mm512_dpbf16_ps(a[0], load32(w0 + k), x0); a[1] = _mm512_dpbf16_ps(a[1], load32(w0 + k + 32), x1);
    a[2] = _mm512_dpbf16_ps(a[2], load32(w1 + k), x0); a[3] = _mm512_dpbf16_ps(a[3], load32(w1 + k + 32), x1);
    a[4] = _mm512_dpbf16_ps(a[4], load32(w2 + k), x0); a[5] = _mm512_dpbf16_ps(a[5], load32(w2 + k + 32), x1);
    a[6] = _mm512_dpbf16_ps(a[6], load32(w3 + k), x0); a[7] = _mm512_dpbf16_ps(a[7], load32(w3 + k + 32), x1);
  }
  for (int r = 0; r < 4; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[2 * r], a[2 * r + 1]));
}
// four adjacent rows of a row-major W (leading dimension ld)
template <int PF>
static inline void dot4(const bf16* w, int64_t ld, const bf16* x, int64_t K, float* out) {
  dot4p<PF>(w, w + ld, w + 2 * ld, w + 3 * ld, x, K, out);
}
// read-only bandwidth reference: sum of vectors
static inline float rd(const bf16* w, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k + 128 <= n; k += 128) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(w + k)); a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(w + k + 32));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(w + k + 64)); a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(w + k + 96));
  }
  return (float)_mm512_reduce_add_epi32(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
}
int main(int argc, char** argv) {
  int64_t K = atoi(argv[1]); int mode = atoi(argv[2]);
  int64_t bytes = 400ll << 20, N = bytes / (2 * K);
  // like the MoE: many 1 MiB matrices; here one big buffer (DRAM-resident, > L3)
  std::vector<bf16> W(N * K), X(K), Y(N);
  for (int64_t i = 0; i < N * K; i++) W[i] = 0x3f80 + (i & 7);
  for (int64_t i = 0; i < K; i++) X[i] = 0x3f80;
  float sink = 0; double best = 1e9;
  for (int rep = 0; rep < 8; rep++) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+:sink)
    {
      int t = omp_get_thread_num(), nt = omp_get_num_threads();
      int64_t b = N * t / nt / 4 * 4, e = N * (t + 1) / nt / 4 * 4;
      float o[4];
      if (mode == 0) for (int64_t n = b; n < e; n++) sink += dot1(&W[n * K], X.data(), K);
      else if (mode == 1) for (int64_t n = b; n < e; n += 4) { dot4<0>(&W[n * K], K, X.data(), K, o); sink += o[0] + o[1] + o[2] + o[3]; }
      else if (mode == 2) for (int64_t n = b; n < e; n += 4) { dot4<512>(&W[n * K], K, X.data(), K, o); sink += o[0] + o[1] + o[2] + o[3]; }
      else if (mode == 3) for (int64_t n = b; n < e; n += 4) { dot4<1024>(&W[n * K], K, X.data(), K, o); sink += o[0] + o[1] + o[2] + o[3]; }
      else if (mode == 4) for (int64_t n = b; n < e; n += 4) { dot4<256>(&W[n * K], K, X.data(), K, o); sink += o[0] + o[1] + o[2] + o[3]; }
      else if (mode == 6 || mode == 7) {  // four far-apart sub-ranges, each sequential
        int64_t q = (e - b) / 4;
        for (int64_t n = 0; n < q; n++) {
          if (mode == 6) dot4p<0>(&W[(b + n) * K], &W[(b + q + n) * K], &W[(b + 2 * q + n) * K], &W[(b + 3 * q + n) * K], X.data(), K, o);
          else dot4p<1024>(&W[(b + n) * K], &W[(b + q + n) * K], &W[(b + 2 * q + n) * K], &W[(b + 3 * q + n) * K], X.data(), K, o);
          sink += o[0] + o[1] + o[2] + o[3];
        }
      }
      else sink += rd(&W[b * K], (e - b) * K);
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  printf("K=%ld mode=%d best %.2f ms  %.1f GB/s (sink %g)\n", K, mode, best * 1e3, bytes / best / 1e9, sink);
}
