// The int8 / int4 decode ops over the kernels of int_kernels.h (which says how they compute):
// one quantized matrix against activation rows, the SwiGLU of several quantized experts on one
// token (the per-layer batched call of the unfused decode, and the per-expert call of streaming), and
// that SwiGLU for a batched decode step (several rows, each routed to its own experts). Rows never
// share a sum: every output row is what the op gives for that row alone.
//
// Ops (namespace colibri_int):
//   int8_linear(x [M,K], codes int8 [N,K], scales [N]) -> [M,N]               x's dtype (bf16|fp32)
//   int4_linear(x [M,K], strips uint8 [N, K/2 + 4K/g], empty, g) -> [M,N]
//   int4_strips(packed uint8 [N,K/2], scales_zeros bf16 [K/g,N,2], g, out uint8 [N, K/2 + 4K/g]) -> bool
//       the stored layout -> the kernel's strips (int_kernels.h), into out, which may be the
//       inputs' own bytes (codes then scales, adjacent): the engine repacks in place as it reads.
//       false (out untouched) where a scale is not finite and > 0 or a zero not finite
//   experts(x [1,H], weights, group) -> [E,H]  SwiGLU of E quantized experts; weights per expert:
//       (gate codes, gate scales, up codes, up scales, down codes, down scales); group 0 = int8
//   experts_rows(x [M,H], weights, group, slot_row int64 [S], slot_expert int64 [S]) -> [S,H]
//       batched decode: slot s is expert slot_expert[s] (of the E given) on row slot_row[s] of x, bit
//       for bit experts(x[r:r+1], that expert alone); the slots sorted by expert (checked); each
//       expert's weights read once for all its slots (int_kernels.h quant_swiglu_slots)

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
  // Every row quantized first, then one parallel pass over the matrix's units in which each unit
  // (16 rows of weights: a few KiB) meets all M rows while it sits in L1 (int4: four rows a pass over
  // it, rows_multi): a prefill's expert reads its weights once, not once per token, and forks once.
  // A row's outputs are what a call with that row alone gives.
  std::vector<float> yf(M * m.N);
  std::vector<QuantRow> xq(M);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {  // each row's quantization is its own
    std::vector<float> xf(m.K);
    for (int64_t r = r0; r < r1; r++) {
      load_f32(x, r * m.K, m.K, xf.data());
      xq[r].set(xf.data(), m.K, m.group);
    }
  });
  at::parallel_for(0, units(m), unit_grain(m), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; u++) {
      const int64_t n0 = unit_row(m, u), n1 = u + 1 < units(m) ? unit_row(m, u + 1) : m.N;
      rows_multi(m, xq.data(), M, n0, n1, yf.data(), m.N);
    }
  });
  at::parallel_for(0, M * m.N, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) store(y, i, yf[i]);
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return linear(x, int8_mat(codes, scales));
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group) {
  return linear(x, int4_mat(packed, sz, group));
}

bool int4_strips(const at::Tensor& packed, const at::Tensor& sz, int64_t group, const at::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "int4_strips: codes must be uint8 [N, K/2]");
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "int4_strips: group must be 32, 64 or 128");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % 2 == 0 && K % group == 0, "int4_strips: N must be even and the group must divide K");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == N &&
              sz.size(2) == 2, "int4_strips: scales_zeros must be bf16 [K/group, N, 2]");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 2 && out.size(0) == N &&
              out.size(1) == K / 2 + 4 * (K / group), "int4_strips: out must be uint8 [N, K/2 + 4 K/group]");
  check_cpu_contiguous(packed, "int4 codes");
  check_cpu_contiguous(sz, "int4 scales_zeros");
  check_cpu_contiguous(out, "int4 strips");
  return repack_strips(packed.data_ptr<uint8_t>(), reinterpret_cast<const bf16*>(sz.data_ptr()), N, K, group,
                       out.data_ptr<uint8_t>());
}

// The op's experts (6 tensors each: gate, up, down codes and scales) as QMats, checked: gate/up
// [I, H], down [H, I], one I for all. Returns E.
int64_t quant_expert_mats(at::TensorList w, int64_t group, int64_t H, const char* op, std::vector<QMat>& gate,
                          std::vector<QMat>& up, std::vector<QMat>& down) {
  TORCH_CHECK(w.size() > 0 && w.size() % 6 == 0, op, ": 6 tensors per expert (gate, up, down: codes, scales)");
  const int64_t E = w.size() / 6;
  gate.resize(E), up.resize(E), down.resize(E);
  for (int64_t e = 0; e < E; e++) {
    const at::Tensor* t = &w[e * 6];
    gate[e] = group ? int4_mat(t[0], t[1], group) : int8_mat(t[0], t[1]);
    up[e] = group ? int4_mat(t[2], t[3], group) : int8_mat(t[2], t[3]);
    down[e] = group ? int4_mat(t[4], t[5], group) : int8_mat(t[4], t[5]);
    TORCH_CHECK(gate[e].K == H && up[e].K == H && up[e].N == gate[e].N && down[e].N == H &&
                down[e].K == gate[e].N && gate[e].N == gate[0].N,
                op, ": gate/up must be [I, H] and down [H, I], the same I for every expert");
  }
  return E;
}

at::Tensor experts(const at::Tensor& x_in, at::TensorList w, int64_t group) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "experts: x must be [1, H]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const int64_t H = x.size(1);
  std::vector<QMat> gate, up, down;
  const int64_t E = quant_expert_mats(w, group, H, "experts", gate, up, down);
  static thread_local std::vector<float> xf;
  static thread_local SwigluScratch s;
  xf.resize(H);
  load_f32(x, 0, H, xf.data());
  quant_swiglu(xf.data(), gate.data(), up.data(), down.data(), E, x.scalar_type() == at::kBFloat16, s);
  at::Tensor y = at::empty({E, H}, x.options());
  for (int64_t i = 0; i < E * H; i++) store(y, i, s.y[i]);
  return y;
}

at::Tensor experts_rows(const at::Tensor& x_in, at::TensorList w, int64_t group, const at::Tensor& slot_row_in,
                        const at::Tensor& slot_expert_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2, "experts_rows: x must be [M, H]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
  const int64_t M = x.size(0), H = x.size(1);
  std::vector<QMat> gate, up, down;
  const int64_t E = quant_expert_mats(w, group, H, "experts_rows", gate, up, down);
  const at::Tensor slot_row = slot_row_in.contiguous(), slot_expert = slot_expert_in.contiguous();
  TORCH_CHECK(slot_row.scalar_type() == at::kLong && slot_expert.scalar_type() == at::kLong && slot_row.dim() == 1 &&
                  slot_expert.sizes() == slot_row.sizes() && slot_row.device().is_cpu() && slot_expert.device().is_cpu(),
              "experts_rows: slot_row and slot_expert must be int64 [S] CPU tensors");
  const int64_t S = slot_row.size(0);
  const int64_t *row = slot_row.data_ptr<int64_t>(), *expert = slot_expert.data_ptr<int64_t>();
  std::vector<int64_t> ex, first;  // the experts with slots, and where each one's slots begin
  std::vector<char> used(M, 0);
  for (int64_t s = 0; s < S; s++) {
    TORCH_CHECK(row[s] >= 0 && row[s] < M, "experts_rows: slot_row[", s, "] = ", row[s], " is not a row of x");
    TORCH_CHECK(expert[s] >= 0 && expert[s] < E, "experts_rows: slot_expert[", s, "] = ", expert[s],
                " is not one of the ", E, " experts");
    TORCH_CHECK(s == 0 || expert[s] >= expert[s - 1], "experts_rows: the slots must be sorted by expert");
    if (s == 0 || expert[s] != expert[s - 1]) ex.push_back(expert[s]), first.push_back(s);
    used[row[s]] = 1;
  }
  first.push_back(S);
  // Each row used quantized once, as the one-row op quantizes its x (load_f32, then QuantRow::set).
  std::vector<QuantRow> xq(M);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(H);
    for (int64_t r = r0; r < r1; r++) {
      if (!used[r]) continue;
      load_f32(x, r * H, H, xf.data());
      xq[r].set(xf.data(), H, group);
    }
  });
  std::vector<const QuantRow*> xs(S);
  for (int64_t s = 0; s < S; s++) xs[s] = &xq[row[s]];
  static thread_local SwigluScratch sc;
  quant_swiglu_slots(xs.data(), gate.data(), up.data(), down.data(), ex.data(), first.data(), (int64_t)ex.size(),
                     x.scalar_type() == at::kBFloat16, sc);
  at::Tensor y = at::empty({S, H}, x.options());
  for (int64_t i = 0; i < S * H; i++) store(y, i, sc.y[i]);
  return y;
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY(colibri_int, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group) -> Tensor");
  m.def("int4_strips(Tensor packed, Tensor scales_zeros, int group, Tensor(a!) out) -> bool");
  m.def("experts(Tensor x, Tensor[] weights, int group) -> Tensor");
  m.def("experts_rows(Tensor x, Tensor[] weights, int group, Tensor slot_row, Tensor slot_expert) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_strips", &int4_strips);
  m.impl("experts", &experts);
  m.impl("experts_rows", &experts_rows);
}
