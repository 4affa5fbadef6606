// The fused int8 / int4 MoE layer of one decode token as inline functions: moe_decode_int.cpp's
// op and decode_step_int.cpp's whole-step loop both run moe_int_rows, so a layer gives the same
// bits either way (and the unfused pieces' bits: moe_decode_int.cpp's header).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "int_kernels.h"
#include "moe_kernels.h"

COLIBRI_INT_TARGET_BEGIN

namespace colibri_int_kernels {

// One layer's operands (checked once by moe_int_layer): `table` holds per expert the addresses of
// its gate, up and down codes and scales (bf16) in the stored layouts, kept alive by the caller.
struct MoeIntLayer {
  const bf16 *norm_w, *router_w;
  const int64_t* table;
  int64_t E, H, I, group;
};

inline MoeIntLayer moe_int_layer(int64_t H, const at::Tensor& norm_w, const at::Tensor& router_w,
                                 const at::Tensor& experts, int64_t k, int64_t inter, int64_t group,
                                 const RoutingTrim& trim) {
  const int64_t E = router_w.size(0), I = inter;
  TORCH_CHECK(router_w.dim() == 2 && router_w.size(1) == H, "moe_layer_int: router_w must be [E, H]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == H, "moe_layer_int: norm_w must be [H]");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == E &&
              experts.size(1) == 6 && experts.is_contiguous(), "moe_layer_int: experts must be int64 [E, 6]");
  TORCH_CHECK(k >= 1 && k <= E && I >= 1, "moe_layer_int: k in 1..E, inter >= 1");
  check_trim(trim, k, "moe_layer_int");
  TORCH_CHECK(group == 0 || ((group == 32 || group == 64 || group == 128) && H % group == 0 && I % group == 0 &&
                             H % 2 == 0 && I % 2 == 0), "moe_layer_int: group 0 (int8) or an int4 group dividing H and I");
  return {bf16_data(norm_w, "norm_w"), bf16_data(router_w, "router_w"), experts.data_ptr<int64_t>(), E, H, I, group};
}

// Per calling thread, reused across calls: no allocation per token.
struct MoeIntScratch {
  std::vector<bf16> normed, ys, mixed;
  std::vector<float> xf, probs, weights;
  std::vector<int64_t> ids;
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<QMat> gate, up, down;
  SwigluScratch swiglu;
};

// y = h + combine(experts of trim(route(rms_norm(h)))) [H], experts in ascending id order. h, y may not alias.
inline void moe_int_rows(const MoeIntLayer& L, const bf16* hp, float eps, int64_t k, bool norm,
                         const RoutingTrim& trim, MoeIntScratch& s, bf16* yp) {
  const int64_t H = L.H, E = L.E, I = L.I, group = L.group;
  s.normed.resize(H), s.ys.resize(k * H), s.mixed.resize(H), s.xf.resize(H);
  s.probs.resize(E), s.weights.resize(k), s.ids.resize(k);
  rms_norm_row(hp, L.norm_w, H, eps, s.normed.data());
  route_topk(s.normed.data(), L.router_w, E, H, k, norm, s.probs.data(), s.ids.data(), s.weights.data());
  s.gate.resize(k), s.up.resize(k), s.down.resize(k);
  const int64_t kept = trim_experts(trim, k, s.ids.data(), s.weights.data());
  ascending_experts(s.ids.data(), s.weights.data(), kept, s.chosen);
  const auto& chosen = s.chosen;
  for (int64_t j = 0; j < kept; j++) {
    const void* const* row = reinterpret_cast<const void* const*>(L.table + 6 * chosen[j].first);
    s.gate[j] = raw_mat(row[0], row[1], I, H, group, false);
    s.up[j] = raw_mat(row[2], row[3], I, H, group, false);
    s.down[j] = raw_mat(row[4], row[5], H, I, group, false);
    s.weights[j] = chosen[j].second;
  }
  for (int64_t n = 0; n < H; n++) s.xf[n] = to_f32(s.normed[n]);
  quant_swiglu(s.xf.data(), s.gate.data(), s.up.data(), s.down.data(), kept, true, s.swiglu);
  for (int64_t i = 0; i < kept * H; i++) s.ys[i] = to_bf16(s.swiglu.y[i]);  // as the experts op stores them
  combine(s.ys.data(), s.weights.data(), kept, H, s.mixed.data());
  for (int64_t n = 0; n < H; n++) yp[n] = to_bf16(to_f32(hp[n]) + to_f32(s.mixed[n]));  // the residual add
}

}  // namespace colibri_int_kernels

COLIBRI_INT_TARGET_END
