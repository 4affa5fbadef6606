// FP8 e4m3 block-scaled matrix-vector products for one decode token, with AVX-512F.
//
// Why: a published FP8 checkpoint (DeepSeek-V3, Kimi-K2, GLM/Qwen3 FP8) stores each linear
// weight as 1 byte per weight plus one fp32 scale per [bn x bk] block. Dequantizing a matrix
// to bf16 before F.linear writes and re-reads 2 bytes per weight on every call; here the bytes
// are converted to fp32 in registers inside the dot product, so a decode step reads each
// weight byte once and nothing else.
//
// e4m3fn → fp32, 16 lanes at a time: bits s.eeee.mmm. Normal (e > 0): fp32 bits
// (eeee.mmm << 20) + (120 << 23) (rebias 7 → 127), subnormal (e == 0): m * 2^-9, computed by an
// int → float conversion so that no fp32 denormal is ever formed (exact under FTZ/DAZ too);
// s.1111.111 is NaN (e4m3fn has no infinity); the sign is or-ed in last.
//
// Arithmetic: y[m, n] = sum over input blocks b of scale[n / bn, b] * (sum over k in b of
// w[n, k] * x[m, k]), fp32 throughout, rounded once to the output dtype (x's: bf16 or fp32).
// Each output is computed by one thread in one fixed order (16-lane accumulator across blocks,
// one horizontal sum at the end) whatever the thread count, so a streamed expert and a cached
// one give the same bits (the placement-invariance tests rely on it).
//
// Op (namespace colibri_fp8):
//   linear(x [M,K] bf16|f32, w [N,K] uint8 (e4m3 bits), scale [ceil(N/bn), ceil(K/bk)] f32,
//          bn, bk) -> [M,N] in x's dtype

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

using colibri_native::GRAIN;
using colibri_native::to_bf16;
using colibri_native::to_f32;

using colibri_native::e4m3_to_f32;  // native_common.h (the quantized KV cache reads e4m3 too)

// Partial sums of one row over the k range [k0, k1): 16-lane fp32 vector.
inline __m512 block_dot(const uint8_t* w, const float* x, int64_t k0, int64_t k1) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = k0;
  for (; k + 16 <= k1; k += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    acc = _mm512_fmadd_ps(e4m3_to_f32(b), _mm512_loadu_ps(x + k), acc);
  }
  if (k < k1) {
    const __mmask16 m = (__mmask16)((1u << (k1 - k)) - 1);
    const __m128i b = _mm_maskz_loadu_epi8(m, w + k);
    acc = _mm512_fmadd_ps(e4m3_to_f32(b), _mm512_maskz_loadu_ps(m, x + k), acc);
  }
  return acc;
}

at::Tensor fp8_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in, int64_t bn,
                      int64_t bk) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1), "fp8_linear: x [M,K], w [N,K]");
  TORCH_CHECK(bn > 0 && bk > 0, "fp8_linear: block sizes must be positive");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "fp8_linear: x must be bf16 or fp32");
  TORCH_CHECK(w_in.element_size() == 1, "fp8_linear: w must hold 1-byte e4m3 codes");
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat && scale_in.dim() == 2, "fp8_linear: scale must be fp32 [nb, kb]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu(), "fp8_linear: CPU tensors only");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const int64_t NB = (N + bn - 1) / bn, KB = (K + bk - 1) / bk;
  TORCH_CHECK(scale.size(0) == NB && scale.size(1) == KB, "fp8_linear: scale shape does not match the blocks");
  // The activations once in fp32 (bf16 → fp32 is exact).
  std::vector<float> xf(M * K);
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(xf.data(), x.data_ptr<float>(), sizeof(float) * M * K);
  } else {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t i = 0; i < M * K; i++) xf[i] = to_f32(xb[i]);
  }
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const float* sp = scale.data_ptr<float>();
  std::vector<float> y(M * N);
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m++) {
      const float* xr = xf.data() + m * K;
      for (int64_t n = begin; n < end; n++) {
        const uint8_t* wr = wp + n * K;
        const float* sr = sp + (n / bn) * KB;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t b = 0; b < KB; b++) {
          const int64_t k0 = b * bk, k1 = k0 + bk < K ? k0 + bk : K;
          acc = _mm512_fmadd_ps(block_dot(wr, xr, k0, k1), _mm512_set1_ps(sr[b]), acc);
        }
        y[m * N + n] = _mm512_reduce_add_ps(acc);
      }
    }
  });
  at::Tensor out = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), y.data(), sizeof(float) * M * N);
  } else {
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < M * N; i++) op[i] = to_bf16(y[i]);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(colibri_fp8, m) {
  m.def("linear(Tensor x, Tensor w, Tensor scale, int bn, int bk) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_fp8, CPU, m) {
  m.impl("linear", &fp8_linear);
}
