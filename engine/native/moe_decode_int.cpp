// One MoE layer of a decode step (T == 1) in one call, for int8 / int4 experts held in RAM: the
// quantized twin of moe_layer_bf16 (moe_decode.cpp).
//
// Why: the unfused decode of a quantized layer is ~6 top-level calls (norm, routing, sort, the
// batched experts op, combine, the residual add) with a Python step and a dispatch between each,
// and every call allocates its outputs; here it is one call, its scratch kept across tokens.
//
// Bits: made of the same inline functions as the separate ops (rms_norm_row, route_topk and combine
// from moe_kernels.h; quant_swiglu from int_kernels.h), in the same order, with the experts' outputs
// rounded to bf16 as the experts op stores them: a layer fused (resident store) and unfused
// (streaming: experts one at a time as their reads land, then combine_bf16) give the same bits.
//
// Op (namespace colibri_int):
//   moe_layer_int(h [1,H], norm_w, eps, router_w [E,H], k, norm, experts int64 [E,6], inter, group, reduction,
//       threshold, renormalize) -> [1,H]
//       h + combine(experts of trim(route(rms_norm(h)))), experts in ascending id order; the trim as
//       moe_layer_bf16's (moe_kernels.h trim_experts; 0, 0 = none); `experts` holds
//       per expert the addresses of its gate, up and down codes and scales in the stored layouts
//       (int_kernels.h; group 0 = int8, else int4 of that group; scales bf16), which the caller keeps
//       alive and has checked for shape (engine/arch/moe_quant.py: ResidentQuantMoeLayer).

#include <torch/library.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "int_kernels.h"
#include "moe_kernels.h"

COLIBRI_INT_TARGET_BEGIN

namespace {

using namespace colibri_int_kernels;

// Per-thread scratch reused across calls: no allocation per token but the output.
struct Scratch {
  std::vector<bf16> normed, ys, mixed;
  std::vector<float> xf, probs, weights;
  std::vector<int64_t> ids;
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<QMat> gate, up, down;
  SwigluScratch swiglu;
};

at::Tensor moe_layer_int(const at::Tensor& h_in, const at::Tensor& norm_w, double eps, const at::Tensor& router_w,
                         int64_t k, bool norm, const at::Tensor& experts, int64_t inter, int64_t group,
                         int64_t reduction, double threshold, bool renormalize) {
  const at::Tensor h = h_in.contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "moe_layer_int: h must be [1, H]");
  const int64_t H = h.size(1), E = router_w.size(0), I = inter;
  TORCH_CHECK(router_w.dim() == 2 && router_w.size(1) == H, "moe_layer_int: router_w must be [E, H]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == H, "moe_layer_int: norm_w must be [H]");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == E &&
              experts.size(1) == 6 && experts.is_contiguous(), "moe_layer_int: experts must be int64 [E, 6]");
  TORCH_CHECK(k >= 1 && k <= E && I >= 1, "moe_layer_int: k in 1..E, inter >= 1");
  const RoutingTrim trim{reduction, threshold, renormalize};
  check_trim(trim, k, "moe_layer_int");
  TORCH_CHECK(group == 0 || ((group == 32 || group == 64 || group == 128) && H % group == 0 && I % group == 0 &&
                             H % 2 == 0 && I % 2 == 0), "moe_layer_int: group 0 (int8) or an int4 group dividing H and I");
  const bf16* hp = bf16_data(h, "h");
  const bf16* rw = bf16_data(router_w, "router_w");
  const bf16* nw = bf16_data(norm_w, "norm_w");
  static thread_local Scratch s;
  s.normed.resize(H), s.ys.resize(k * H), s.mixed.resize(H), s.xf.resize(H);
  s.probs.resize(E), s.weights.resize(k), s.ids.resize(k);
  rms_norm_row(hp, nw, H, (float)eps, s.normed.data());
  route_topk(s.normed.data(), rw, E, H, k, norm, s.probs.data(), s.ids.data(), s.weights.data());
  s.gate.resize(k), s.up.resize(k), s.down.resize(k);
  const int64_t kept = trim_experts(trim, k, s.ids.data(), s.weights.data());
  ascending_experts(s.ids.data(), s.weights.data(), kept, s.chosen);
  const auto& chosen = s.chosen;
  const int64_t* table = experts.data_ptr<int64_t>();
  for (int64_t j = 0; j < kept; j++) {
    const void* const* row = reinterpret_cast<const void* const*>(table + 6 * chosen[j].first);
    s.gate[j] = raw_mat(row[0], row[1], I, H, group, false);
    s.up[j] = raw_mat(row[2], row[3], I, H, group, false);
    s.down[j] = raw_mat(row[4], row[5], H, I, group, false);
    s.weights[j] = chosen[j].second;
  }
  for (int64_t n = 0; n < H; n++) s.xf[n] = to_f32(s.normed[n]);
  quant_swiglu(s.xf.data(), s.gate.data(), s.up.data(), s.down.data(), kept, true, s.swiglu);
  for (int64_t i = 0; i < kept * H; i++) s.ys[i] = to_bf16(s.swiglu.y[i]);  // as the experts op stores them
  combine(s.ys.data(), s.weights.data(), kept, H, s.mixed.data());
  at::Tensor y = at::empty({1, H}, h.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t n = 0; n < H; n++) yp[n] = to_bf16(to_f32(hp[n]) + to_f32(s.mixed[n]));  // the residual add
  return y;
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY_FRAGMENT(colibri_int, m) {
  m.def("moe_layer_int(Tensor h, Tensor norm_w, float eps, Tensor router_w, int k, bool norm, Tensor experts, "
        "int inter, int group, int reduction=0, float threshold=0., bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) { m.impl("moe_layer_int", &moe_layer_int); }
