// The int8 / int4 decode ops over the kernels of int_kernels.h (which says how they compute):
// one quantized matrix against activation rows, and the SwiGLU of several quantized experts on one
// token (the per-layer batched call of the unfused decode, and the per-expert call of streaming).
//
// Ops (namespace colibri_int):
//   int8_linear(x [M,K], codes int8 [N,K], scales [N]) -> [M,N]               x's dtype (bf16|fp32)
//   int4_linear(x [M,K], packed uint8 [N,K/2], scales_zeros [K/g,N,2], g) -> [M,N]
//   experts(x [1,H], weights, group) -> [E,H]  SwiGLU of E quantized experts; weights per expert:
//       (gate codes, gate scales, up codes, up scales, down codes, down scales); group 0 = int8

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "int_kernels.h"

COLIBRI_INT_TARGET_BEGIN

namespace {

using namespace colibri_int_kernels;

at::Tensor linear(const at::Tensor& x_in, const QMat& m) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == m.K, "x must be [M, K] with the weight's K");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, m.N}, x.options());
  std::vector<float> xf(m.K), yf(m.N);
  QuantRow xq;
  for (int64_t r = 0; r < M; r++) {
    load_f32(x, r * m.K, m.K, xf.data());
    xq.set(xf.data(), m.K, m.group);
    at::parallel_for(0, units(m), unit_grain(m), [&](int64_t u0, int64_t u1) {
      const int64_t n0 = unit_row(m, u0), n1 = u1 < units(m) ? unit_row(m, u1) : m.N;
      rows(m, xq, n0, n1, yf.data() + n0);
    });
    for (int64_t n = 0; n < m.N; n++) store(y, r * m.N + n, yf[n]);
  }
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return linear(x, int8_mat(codes, scales));
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group) {
  return linear(x, int4_mat(packed, sz, group));
}

at::Tensor experts(const at::Tensor& x_in, at::TensorList w, int64_t group) {
  TORCH_CHECK(w.size() > 0 && w.size() % 6 == 0, "experts: 6 tensors per expert (gate, up, down: codes, scales)");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "experts: x must be [1, H]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const int64_t E = w.size() / 6, H = x.size(1);
  std::vector<QMat> gate(E), up(E), down(E);
  for (int64_t e = 0; e < E; e++) {
    const at::Tensor* t = &w[e * 6];
    gate[e] = group ? int4_mat(t[0], t[1], group) : int8_mat(t[0], t[1]);
    up[e] = group ? int4_mat(t[2], t[3], group) : int8_mat(t[2], t[3]);
    down[e] = group ? int4_mat(t[4], t[5], group) : int8_mat(t[4], t[5]);
    TORCH_CHECK(gate[e].K == H && up[e].K == H && up[e].N == gate[e].N && down[e].N == H &&
                down[e].K == gate[e].N && gate[e].N == gate[0].N,
                "experts: gate/up must be [I, H] and down [H, I], the same I for every expert");
  }
  static thread_local std::vector<float> xf;
  static thread_local SwigluScratch s;
  xf.resize(H);
  load_f32(x, 0, H, xf.data());
  quant_swiglu(xf.data(), gate.data(), up.data(), down.data(), E, x.scalar_type() == at::kBFloat16, s);
  at::Tensor y = at::empty({E, H}, x.options());
  for (int64_t i = 0; i < E * H; i++) store(y, i, s.y[i]);
  return y;
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY(colibri_int, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group) -> Tensor");
  m.def("experts(Tensor x, Tensor[] weights, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("experts", &experts);
}
