// The attention half of a decode token with int8 / int4 projections (a `--scope all` container's
// q/k/v/o QuantWeights): attention_rows (attention_kernels.h) instantiated on QuantProj, whose rows
// are int_kernels.h's. Shared by attention_decode_int.cpp's per-layer op and decode_step_int.cpp's
// whole step, so a layer gives the same bits either way.
//
// Bits of the projections: the int linear op (int_decode.cpp) quantizes its bf16 input row once
// per call (QuantRow of the row's exact fp32 copy, the matrix's group) and rounds each output to
// bf16 once; q, k and v are three calls on the same normed row and o_proj one on the attention
// output. QuantProj does exactly that: the normed row quantized once for the three (the same
// QuantRow each call would make), the attention output once for o_proj, each output row computed by
// int_kernels.h's rows() (one thread, one fixed order whatever the split) and rounded as the op
// stores it. So q/k/v, the K/V rows written and o_proj's output are the unfused path's bits; only
// the attention in between differs from SDPA (attention_decode.cpp's header).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_kernels.h"
#include "int_kernels.h"

COLIBRI_INT_TARGET_BEGIN

namespace colibri_int_kernels {

// A layer's projections as QMats of one kind (group 0: int8, else int4 of that group). Several
// activation rows (a batched step): each quantized on its own, each weight unit read once for all of
// them (int_kernels.h rows_slots), each row's outputs rows()' bits for it alone.
struct QuantProj {
  QMat q, k, v, o;  // q [Nq D, H], k and v [Nkv D, H], o [H, Nq D]
  struct Scratch {
    std::vector<float> xf, yf;  // an input row as fp32; the projections' fp32 outputs [B, ld]
    std::vector<QuantRow> xq;   // the input rows, quantized
    std::vector<const QuantRow*> xs;
    int64_t ld = 0;
  };
  static constexpr bool prepares_out = true;

  static void quantize(const bf16* const* x, int64_t B, int64_t K, int64_t group, Scratch& s) {
    s.xf.resize(K);
    if ((int64_t)s.xq.size() < B) s.xq.resize(B);
    s.xs.resize(B);
    for (int64_t r = 0; r < B; r++) {
      for (int64_t i = 0; i < K; i++) s.xf[i] = to_f32(x[r][i]);  // exact: load_f32 of a bf16 row
      s.xq[r].set(s.xf.data(), K, group);
      s.xs[r] = &s.xq[r];
    }
  }
  void prepare_in(const bf16* const* x, int64_t B, int64_t H, Scratch& s) const {
    quantize(x, B, H, q.group, s);
    s.ld = std::max(q.N + k.N + v.N, o.N);
    s.yf.resize(B * s.ld);
  }
  void prepare_out(const bf16* const* a, int64_t B, int64_t Q, Scratch& s) const { quantize(a, B, Q, o.group, s); }

  // This thread's share of the work units of the three matrices taken as one sequence (q's, then
  // k's, then v's), rows emitted at their offset in [q | k | v].
  template <class Emit>
  void qkv_rows(const bf16* const*, int64_t B, int64_t, int64_t, int t, int T, Scratch& s, Emit emit) const {
    const QMat* mats[3] = {&q, &k, &v};
    int64_t b, e;
    thread_share(units(q) + units(k) + units(v), t, T, b, e);
    for (int64_t i = 0, u_base = 0, row_base = 0; i < 3; i++) {
      const QMat& m = *mats[i];
      const int64_t n = units(m);
      share_rows(m, std::max<int64_t>(b - u_base, 0), std::min(e - u_base, n), B, s, row_base, emit);
      u_base += n, row_base += m.N;
    }
  }
  template <class Emit>
  void o_rows(const bf16* const*, int64_t B, int64_t, int64_t, int t, int T, Scratch& s, Emit emit) const {
    int64_t b, e;
    thread_share(units(o), t, T, b, e);
    share_rows(o, b, e, B, s, 0, emit);
  }

  // Units [u0, u1) of m into s.yf at row_base, then emit(row, row_base + n, value) for each of its
  // rows and each activation row (one row: rows() itself, through rows_slots).
  template <class Emit>
  static void share_rows(const QMat& m, int64_t u0, int64_t u1, int64_t B, Scratch& s, int64_t row_base, Emit emit) {
    if (u0 >= u1) return;
    const int64_t n0 = unit_row(m, u0), n1 = u1 < units(m) ? unit_row(m, u1) : m.N;
    float* out = s.yf.data() + row_base;
    rows_slots(m, s.xs.data(), B, n0, n1, out, s.ld);
    for (int64_t r = 0; r < B; r++)
      for (int64_t n = n0; n < n1; n++) emit(r, row_base + n, out[r * s.ld + n]);
  }
};

inline QMat proj_mat(const at::Tensor& codes, const at::Tensor& scales, int64_t group) {
  return group ? int4_mat(codes, scales, group) : int8_mat(codes, scales);
}

// A layer's operands: its norms and caches as the bf16 op takes them, proj = (q, k, v, o) codes and
// scales in the stored layouts (8 tensors), `group` their kind.
inline AttnLayer<QuantProj> attention_layer_int(int64_t H, const at::Tensor& norm_w, const at::Tensor& q_norm,
                                                const at::Tensor& k_norm, const at::Tensor* proj, int64_t group,
                                                const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                const at::Tensor& k_scales, const at::Tensor& v_scales,
                                                int64_t heads, int64_t kv_heads) {
  AttnLayer<QuantProj> L;
  attention_common(H, norm_w, q_norm, k_norm, k_cache, v_cache, k_scales, v_scales, heads, kv_heads,
                   "attention_decode_int", L);
  TORCH_CHECK(group == 0 || group == 32 || group == 64 || group == 128,
              "attention_decode_int: group 0 (int8) or an int4 group of 32, 64 or 128");
  QuantProj& P = L.proj;
  P.q = proj_mat(proj[0], proj[1], group);
  P.k = proj_mat(proj[2], proj[3], group);
  P.v = proj_mat(proj[4], proj[5], group);
  P.o = proj_mat(proj[6], proj[7], group);
  const int64_t Q = heads * L.D, KV = kv_heads * L.D;
  TORCH_CHECK(P.q.N == Q && P.k.N == KV && P.v.N == KV && P.q.K == H && P.k.K == H && P.v.K == H,
              "attention_decode_int: q must be [Nq D, H], k and v [Nkv D, H]");
  TORCH_CHECK(P.o.N == H && P.o.K == Q, "attention_decode_int: o must be [H, Nq D]");
  return L;
}

}  // namespace colibri_int_kernels

COLIBRI_INT_TARGET_END
