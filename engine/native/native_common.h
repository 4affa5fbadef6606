// What every native decode kernel here shares: bf16 <-> fp32 conversions with torch's rounding,
// tensor checks, and the parallel grain. Included by each .cpp (one library, one namespace per
// file's ops); header-only, every function inline, so each file keeps its own copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace colibri_native {

using bf16 = uint16_t;

inline bf16 to_bf16(float f) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

inline float to_f32(bf16 b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

// e4m3fn -> fp32, 16 lanes at a time: bits s.eeee.mmm. Normal (e > 0): fp32 bits
// (eeee.mmm << 20) + (120 << 23) (rebias 7 -> 127), subnormal (e == 0): m * 2^-9, computed by an
// int -> float conversion so that no fp32 denormal is ever formed (exact under FTZ/DAZ too);
// s.1111.111 is NaN (e4m3fn has no infinity); the sign is or-ed in last. The same values as
// torch's c10::Float8_e4m3fn -> float. Used by fp8_decode.cpp (weights) and attention_kernels.h
// (the fp8 KV cache).
inline __m512 e4m3_to_f32(__m128i bytes) {
  const __m512i v = _mm512_cvtepu8_epi32(bytes);
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 subv = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
  normal = _mm512_mask_blend_ps(sub, normal, subv);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
  normal = _mm512_mask_blend_ps(nan, normal, _mm512_set1_ps(__builtin_nanf("")));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(normal), sign));
}

// Rows per parallel task at least: a weight row is 0.5-4 KiB, so a task streams >= 8 KiB.
constexpr int64_t GRAIN = 16;

inline void check_cpu_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

// Activations (bf16 or fp32, x's dtype) as fp32: bf16 -> fp32 is exact.
inline void load_f32(const at::Tensor& x, int64_t offset, int64_t n, float* out) {
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out, x.data_ptr<float>() + offset, sizeof(float) * n);
  } else {
    const bf16* p = reinterpret_cast<const bf16*>(x.data_ptr()) + offset;
    for (int64_t i = 0; i < n; i++) out[i] = to_f32(p[i]);
  }
}

// Stores one output value in the output's dtype (bf16: rounded once).
inline void store(at::Tensor& y, int64_t i, float v) {
  if (y.scalar_type() == at::kFloat)
    y.data_ptr<float>()[i] = v;
  else
    reinterpret_cast<bf16*>(y.data_ptr())[i] = to_bf16(v);
}

}  // namespace colibri_native
