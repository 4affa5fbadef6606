// The int4 decode kernel's inner loop outside the engine: which layout and instruction mix reads int4
// weights fastest, from DRAM and from L2 (docs/BENCHMARKS.md, "int4 strips"). Random codes in
// [N, K] int4-g32 matrices (bf16 scale and zero per group), walked 8 matrices a call as a MoE layer
// walks its experts, every thread (argv[1]) a contiguous share of the 64-row units, 7 passes, median:
//   bf16 dot rows              bf16 rows of the same working set (engine/native/bf16_kernels.h dot)
//   int4 blocked (before)      the stored 64-row blocked layout, 4 byte permutes + 4 vpdpwssd per
//                              64 bytes, scales [K/g, N, 2] read per group: the engine's kernel before
//                              the strips (with its 1 KiB software prefetch)
//   int4 busd strips, [G,N,2]  16-row strips, vpdpbusd, the scales left in the stored [K/g, N, 2] order
//   int4 busd strips noscale   the same without reading scales (GB/s still counts them)
//   int4 busd strips inlscale  16-row strips, scales inline after each group's codes, vpdpbusd on int8
//                              activations: the engine's kernel now (engine/native/int_kernels.h)
//   int4 busd strips 2stream   the same codes, the scales as a second sequential stream
//   int4 busd 2stream pf512 / pf1024   that with a software prefetch of the scale stream
// GB/s counts codes + scales. Build and run (argv: threads N K working-set-KiB; 512 MiB: DRAM,
// 1024 KiB: L2):
//   g++ -O3 -march=native -fopenmp benchmarks/quant/int4_layout_probe.cpp -o int4_layout_probe
//   for t in 1 2; do ./int4_layout_probe $t 512 1024 524288; ./int4_layout_probe $t 512 1024 1024; done
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <cmath>
#include <algorithm>
using bf16 = uint16_t;
constexpr int64_t BLOCK = 64;
struct PairIndex { __m512i low, high; PairIndex() { alignas(64) uint8_t a[64], b[64];
  for (int r = 0; r < 16; r++) { a[4*r]=r; a[4*r+2]=32+r; b[4*r]=16+r; b[4*r+2]=48+r; a[4*r+1]=a[4*r+3]=b[4*r+1]=b[4*r+3]=0; }
  low=_mm512_load_si512(a); high=_mm512_load_si512(b);} };
constexpr __mmask64 EVEN_BYTES = 0x5555555555555555ull;
struct Mat { int64_t N, K, group; const uint8_t* packed; const bf16* scales; };
struct XRow { std::vector<int16_t> q; float sx; std::vector<int32_t> qsum; std::vector<float> xsum; };

template <int AHEAD, int HINT, int SCALEPF>
__attribute__((noinline)) void int4_block(const Mat& m, int64_t nb, const XRow& x, float* out) {
  static const PairIndex idx;
  const uint8_t* base = m.packed + nb * BLOCK * m.K / 2;
  const bool next_block = (nb + 2) * BLOCK <= m.N;
  const int32_t* xpairs = reinterpret_cast<const int32_t*>(x.q.data());
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512 sx = _mm512_set1_ps(x.sx);
  __m512 y[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const int64_t G = m.K / m.group;
  for (int64_t g = 0; g < G; g++) {
    __m512i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k = g * m.group; k < (g + 1) * m.group; k += 4) {
      for (int h = 0; h < 2; h++) {
        if (AHEAD > 0) _mm_prefetch(reinterpret_cast<const char*>(base + (k + 2 * h) * 32 + AHEAD), (_mm_hint)HINT);
        const __m512i bytes = _mm512_loadu_si512(base + (k + 2 * h) * 32);
        const __m512i lo = _mm512_and_si512(bytes, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
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
    if (SCALEPF && next_block)
      for (int i = 0; i < 4; i++)
        _mm_prefetch(reinterpret_cast<const char*>(m.scales + (g * m.N + (nb + 1) * BLOCK) * 2) + 64 * i, _MM_HINT_T0);
    for (int i = 0; i < 4; i++) {
      const __m512i d = _mm512_loadu_si512(m.scales + (g * m.N + nb * BLOCK + 16 * i) * 2);
      __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
      __m512 z = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], mid));
      y[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, sx), dot, _mm512_fmadd_ps(z, xs, y[i]));
    }
  }
  for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + 16 * i, y[i]);
}


// 16-row strips, 4 k per lane (u8 codes), int8 activations broadcast; per group cvt + fma (timing only:
// its output arithmetic is not the engine's); SMODE picks where the scales are read from
template <int SMODE>
__attribute__((noinline)) void int4_busd(const Mat& m, int64_t nb, const XRow& x, float* out) {
  const uint8_t* base = m.packed + nb * BLOCK * m.K / 2;   // 64 rows = 4 x 16-row strips, each K/2*16 bytes
  const int8_t* x8 = reinterpret_cast<const int8_t*>(x.q.data());
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t G = m.K / m.group;
  for (int s = 0; s < 4; s++) {
    const uint8_t* p = base + s * (m.K / 2) * 16 * (SMODE == 2 ? 5 : 4) / 4;
    __m512 y = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
      for (int64_t k = g * m.group; k < (g + 1) * m.group; k += 8) {
        const __m512i bytes = _mm512_loadu_si512(p + k * 8 + (SMODE == 2 ? g * 64 : 0));
        const __m512i lo = _mm512_and_si512(bytes, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
        a0 = _mm512_dpbusd_epi32(a0, lo, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x8 + k)));
        a1 = _mm512_dpbusd_epi32(a1, hi, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x8 + k + 4)));
      }
      if (SMODE == 4) _mm_prefetch(reinterpret_cast<const char*>(m.scales + ((nb * 4 + s) * G + g) * 32) + 512, _MM_HINT_T0);
      if (SMODE == 5) _mm_prefetch(reinterpret_cast<const char*>(m.scales + ((nb * 4 + s) * G + g) * 32) + 1024, _MM_HINT_T0);
      const __m512i d = SMODE == 0 ? _mm512_loadu_si512(m.scales + (g * m.N + nb * BLOCK + 16 * s) * 2) : SMODE == 1 ? _mm512_set1_epi32(0x3c003c00) : SMODE == 2 ? _mm512_loadu_si512(p + (g + 1) * 256 + g * 64) : _mm512_loadu_si512(m.scales + ((nb * 4 + s) * G + g) * 32);
      __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
      __m512 z = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32((int)0xffff0000u)));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(8 * x.qsum[g])));
      y = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(x.xsum[g])), dot, _mm512_fmadd_ps(z, _mm512_set1_ps(x.xsum[g]), y));
    }
    _mm512_storeu_ps(out + 16 * s, y);
  }
}

// bf16 reference: row dots
__attribute__((noinline)) float dotbf(const bf16* w, const bf16* x, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t k = 0; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

static void* arena(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, n, MADV_HUGEPAGE);
  memset(p, 0x5a, n);
  return p;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const int64_t N = argc > 2 ? atoll(argv[2]) : 512, K = argc > 3 ? atoll(argv[3]) : 1024, group = 32;
  const size_t ws = (size_t)(argc > 4 ? atoll(argv[4]) : 512) << 10;
  const int64_t codes_b = N * K / 2, sc_b = K / group * N * 4, mat_b = codes_b + sc_b;
  const int64_t M = ws / mat_b;
  uint8_t* buf = (uint8_t*)arena(M * mat_b);
  for (size_t i = 0; i < (size_t)M * mat_b; i++) buf[i] = (uint8_t)(i * 2654435761u >> 13);
  // scales: make them sane bf16 (0.01)
  std::vector<Mat> mats(M);
  for (int64_t i = 0; i < M; i++) {
    mats[i] = {N, K, group, buf + i * mat_b, (const bf16*)(buf + i * mat_b + codes_b)};
  }
  XRow x; x.q.assign(K, 0); for (int64_t k = 0; k < K; k++) x.q[k] = (int16_t)((k * 37) % 2001 - 1000);
  x.sx = 1e-4f; x.qsum.assign(K / group, 3); x.xsum.assign(K / group, 0.1f);
  std::vector<float> out((size_t)N * threads * 2);
  bf16* bfw = (bf16*)arena(ws);  // bf16 reference: same byte working set
  const int64_t bfrows = ws / (K * 2);
  std::vector<bf16> xb(K, 0x3c00);
  omp_set_num_threads(threads);
  auto run = [&](auto fn, const char* name) {
    double best = 0; std::vector<double> rates;
    for (int rep = 0; rep < 7; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < (M < 64 ? 2000 : 1); it++) for (int64_t i = 0; i < M; i += 8) {
        const int64_t e1 = std::min(M, i + 8);
        const int64_t units = (e1 - i) * (N / BLOCK);
#pragma omp parallel for schedule(static)
        for (int64_t u = 0; u < units; u++) {
          fn(mats[i + u / (N / BLOCK)], u % (N / BLOCK), x, out.data() + omp_get_thread_num() * 64);
        }
      }
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates.push_back((M < 64 ? 2000.0 : 1.0) * M * mat_b / dt / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    printf("%-28s thr %d  GB/s median %.1f  (min %.1f max %.1f)\n", name, threads, rates[3], rates[0], rates[6]);
  };
  auto bfrun = [&]() {
    std::vector<double> rates;
    for (int rep = 0; rep < 7; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t r0 = 0; r0 < bfrows; r0 += 8 * 3 * 512) {
        const int64_t r1 = std::min(bfrows, r0 + 8 * 3 * 512);
#pragma omp parallel for schedule(static)
        for (int64_t r = r0; r < r1; r++) out[omp_get_thread_num()] += dotbf(bfw + r * K, xb.data(), K);
      }
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates.push_back(bfrows * K * 2 / dt / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    printf("%-28s thr %d  GB/s median %.1f  (min %.1f max %.1f)\n", "bf16 dot rows", threads, rates[3], rates[0], rates[6]);
  };
  for (int round = 0; round < 2; round++) {
    bfrun();
    run(int4_block<1024, _MM_HINT_T0, 1>, "int4 blocked (before)");
    run(int4_busd<0>, "int4 busd strips, [G,N,2]");
    run(int4_busd<1>, "int4 busd strips noscale");
    run(int4_busd<2>, "int4 busd strips inlscale");
    run(int4_busd<3>, "int4 busd strips 2stream");
    run(int4_busd<4>, "int4 busd 2stream pf512");
    run(int4_busd<5>, "int4 busd 2stream pf1024");
  }
}
