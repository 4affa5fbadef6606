// MXFP4 matrix-vector products straight from the stored blocks (gpt-oss experts), AVX-512F.
//
// Why: the published gpt-oss experts are MXFP4, 4.25 bits per weight: per output row, blocks of
// 32 FP4 e2m1 codes (16 bytes, two codes a byte, low nibble first) and one e8m0 exponent byte
// per block (2^(s-127)). Dequantizing an expert to bf16 before the matmul writes and reads back
// 3.8x its stored bytes and costs more than reading it from an NVMe disk; here the codes are
// decoded in registers inside the dot product, so the weights are touched once, at their
// stored size.
//
// Per 32 weights: 16 bytes widened to 16 int32 lanes; low and high nibbles index a 16-entry
// fp32 table with one vpermps each (the values of the even and the odd elements); the block's
// power of two multiplies both (exact: FP4 values times a power of two are representable,
// subnormals included); two FMAs against the input's even and odd elements, deinterleaved once
// per call.
//
// Results: each product is the dequantized weight times x, exactly as the torch reference
// (dequantize, then F.linear) forms it; sums are fp32 in a fixed order (two accumulators, even
// and odd elements, over the blocks, then one horizontal sum, then the bias), output rounded
// once to x's dtype. Every output element is computed by one thread, whatever the thread count
// and split, so a streamed and a resident expert give the same bits. Rows of x go in groups of
// up to four sharing each decoded block (prefill); a row's sum does not depend on its group.
//
// Op (namespace colibri):
//   mxfp4_linear(x [M,K] f32|bf16, blocks [N,K/32,16] u8, scales [N,K/32] u8, bias [N]?) -> [M,N]
//       y = x @ dequant(blocks, scales).T + bias

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "native_common.h"

namespace {

using colibri_native::GRAIN;
using colibri_native::to_bf16;
using colibri_native::to_f32;

constexpr int64_t MX_BLOCK = 32;  // values per scale
constexpr int64_t HALF = 16;       // even (or odd) values per block, one zmm of fp32
constexpr int MAX_ROWS = 4;        // rows of x sharing one decoded block

struct Pow2Table {  // e8m0 byte -> 2^(s-127) as fp32; 255 (E8M0 NaN) -> inf, as torch.exp2 gives
  float v[256];
  Pow2Table() {
    for (int s = 0; s < 256; s++) v[s] = std::ldexp(1.0f, s - 127);
  }
};
const Pow2Table POW2;

// out[r] for rows r < MB of x (deinterleaved: xe/xo [MB][G*16]) against weight row `blocks`/`scales`.
template <int MB>
inline void row_dot(const uint8_t* blocks, const uint8_t* scales, int64_t G, const float* xe, const float* xo,
                    int64_t stride, float* out) {
  const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  __m512 even[MB], odd[MB];
  for (int r = 0; r < MB; r++) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + g * HALF)));
    const __m512 scale = _mm512_set1_ps(POW2.v[scales[g]]);
    const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, nibble), lut), scale);
    const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut), scale);
    for (int r = 0; r < MB; r++) {
      even[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + r * stride + g * HALF), even[r]);
      odd[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + r * stride + g * HALF), odd[r]);
    }
  }
  for (int r = 0; r < MB; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

void rows_dot(int mb, const uint8_t* blocks, const uint8_t* scales, int64_t G, const float* xe, const float* xo,
              int64_t stride, float* out) {
  switch (mb) {
    case 1: return row_dot<1>(blocks, scales, G, xe, xo, stride, out);
    case 2: return row_dot<2>(blocks, scales, G, xe, xo, stride, out);
    case 3: return row_dot<3>(blocks, scales, G, xe, xo, stride, out);
    default: return row_dot<4>(blocks, scales, G, xe, xo, stride, out);
  }
}

at::Tensor mxfp4_linear(const at::Tensor& x_in, const at::Tensor& blocks, const at::Tensor& scales,
                        const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "mxfp4_linear: x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "mxfp4_linear: x must be float32 or bfloat16");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte,
              "mxfp4_linear: blocks and scales must be uint8");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == HALF, "mxfp4_linear: blocks must be [N, K/32, 16]");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "mxfp4_linear: scales must be [N, K/32]");
  TORCH_CHECK(blocks.is_contiguous() && scales.is_contiguous() && blocks.device().is_cpu() && scales.device().is_cpu(),
              "mxfp4_linear: blocks and scales must be contiguous CPU tensors");
  const int64_t M = x_in.size(0), N = blocks.size(0), G = blocks.size(1), K = G * MX_BLOCK;
  TORCH_CHECK(x_in.size(1) == K, "mxfp4_linear: x has ", x_in.size(1), " columns, the blocks hold ", K);
  const at::Tensor x = x_in.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  std::vector<float> bias(N, 0.0f);
  if (bias_in.has_value()) {
    const at::Tensor b = bias_in->contiguous().to(at::kFloat);
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N, "mxfp4_linear: bias must be [N]");
    std::memcpy(bias.data(), b.data_ptr<float>(), N * sizeof(float));
  }

  // Even and odd elements of each block apart, fp32: [M][G*16] each.
  const int64_t stride = G * HALF;
  std::vector<float> xe(M * stride), xo(M * stride);
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k += 2) {
      const int64_t i = m * K + k;
      xe[m * stride + k / 2] = bf16 ? to_f32(xb[i]) : xf[i];
      xo[m * stride + k / 2] = bf16 ? to_f32(xb[i + 1]) : xf[i + 1];
    }

  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS];
    for (int64_t n = begin; n < end; n++) {
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int mb = (int)std::min<int64_t>(MAX_ROWS, M - m0);
        rows_dot(mb, bp + n * G * HALF, sp + n * G, G, xe.data() + m0 * stride, xo.data() + m0 * stride, stride, sums);
        for (int r = 0; r < mb; r++) {
          const float v = sums[r] + bias[n];
          if (bf16)
            yb[(m0 + r) * N + n] = to_bf16(v);
          else
            yf[(m0 + r) * N + n] = v;
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("mxfp4_linear(Tensor x, Tensor blocks, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("mxfp4_linear", &mxfp4_linear);
}
