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


// Per calling thread, reused across calls (moe_int_batch's).
struct MoeIntBatchScratch {
  std::vector<bf16> normed, ys;                       // normed [M, H], ys [S, H]
  std::vector<float> xf, probs, weights;              // weights [M, k]: row r's j-th expert (ascending id)
  std::vector<int64_t> ids, kept, row_slot, ex, first;  // row_slot [M, k]: the slot of row r's j-th expert
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<std::pair<int64_t, int64_t>> order;     // (expert, row * k + j): the slots sorted by expert
  std::vector<QuantRow> xq;                           // each row's normed input, quantized once
  std::vector<const QuantRow*> xs;                    // per slot, its row's
  std::vector<QMat> gate, up, down;                   // per union expert
  SwigluScratch swiglu;
};

// moe_int_rows for M rows at once, each its own token: y[r] = h[r] + combine(experts of
// trim(route(rms_norm(h[r])))), every row bit for bit moe_int_rows on that row alone. Each row routes
// as moe_int_rows routes it (route_topk: the router is small next to the experts); the experts of
// the union of the rows' routes run as one quant_swiglu_slots, each unit of their weights read once
// for all the slots that need it, each slot quant_swiglu's bits for its row and expert alone; then
// per row combine()'s sum (ascending expert order, fp32, rounded) and the residual add.
inline void moe_int_batch(const MoeIntLayer& L, const bf16* const* hp, int64_t M, float eps, int64_t k, bool norm,
                          const RoutingTrim& trim, MoeIntBatchScratch& s, bf16* const* yp) {
  const int64_t H = L.H, E = L.E, I = L.I, group = L.group;
  s.normed.resize(M * H), s.xf.resize(H), s.probs.resize(E), s.weights.resize(M * k), s.ids.resize(M * k);
  s.kept.resize(M), s.row_slot.resize(M * k);
  if ((int64_t)s.xq.size() < M) s.xq.resize(M);
  s.order.clear();
  for (int64_t r = 0; r < M; r++) {
    bf16* normed = s.normed.data() + r * H;
    int64_t* ids = s.ids.data() + r * k;
    float* w = s.weights.data() + r * k;
    rms_norm_row(hp[r], L.norm_w, H, eps, normed);
    route_topk(normed, L.router_w, E, H, k, norm, s.probs.data(), ids, w);
    s.kept[r] = trim_experts(trim, k, ids, w);
    ascending_experts(ids, w, s.kept[r], s.chosen);
    for (int64_t j = 0; j < s.kept[r]; j++) {
      w[j] = s.chosen[j].second;
      s.order.push_back({s.chosen[j].first, r * k + j});
    }
    for (int64_t n = 0; n < H; n++) s.xf[n] = to_f32(normed[n]);
    s.xq[r].set(s.xf.data(), H, group);  // as quant_swiglu quantizes its token
  }
  std::sort(s.order.begin(), s.order.end());
  const int64_t S = (int64_t)s.order.size();
  s.xs.resize(S), s.ex.clear(), s.first.clear(), s.gate.clear(), s.up.clear(), s.down.clear();
  for (int64_t slot = 0; slot < S; slot++) {
    const auto [expert, rj] = s.order[slot];
    if (slot == 0 || expert != s.order[slot - 1].first) {
      const void* const* row = reinterpret_cast<const void* const*>(L.table + 6 * expert);
      s.ex.push_back((int64_t)s.gate.size()), s.first.push_back(slot);
      s.gate.push_back(raw_mat(row[0], row[1], I, H, group, false));
      s.up.push_back(raw_mat(row[2], row[3], I, H, group, false));
      s.down.push_back(raw_mat(row[4], row[5], H, I, group, false));
    }
    s.row_slot[rj] = slot;
    s.xs[slot] = &s.xq[rj / k];
  }
  s.first.push_back(S);
  quant_swiglu_slots(s.xs.data(), s.gate.data(), s.up.data(), s.down.data(), s.ex.data(), s.first.data(),
                     (int64_t)s.ex.size(), true, s.swiglu);
  s.ys.resize(S * H);
  for (int64_t i = 0; i < S * H; i++) s.ys[i] = to_bf16(s.swiglu.y[i]);  // as the experts op stores them
  for (int64_t r = 0; r < M; r++) {  // combine()'s sum per output, rounded, then the residual add
    const int64_t kept = s.kept[r];
    const float* w = s.weights.data() + r * k;
    const int64_t* slot = s.row_slot.data() + r * k;
    for (int64_t n = 0; n < H; n++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < kept; j++) acc += w[j] * to_f32(s.ys[slot[j] * H + n]);
      yp[r][n] = to_bf16(to_f32(hp[r][n]) + round_bf16(acc));
    }
  }
}

}  // namespace colibri_int_kernels

COLIBRI_INT_TARGET_END
