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

#include "moe_int.h"

COLIBRI_INT_TARGET_BEGIN

namespace {

using namespace colibri_int_kernels;

at::Tensor moe_layer_int(const at::Tensor& h_in, const at::Tensor& norm_w, double eps, const at::Tensor& router_w,
                         int64_t k, bool norm, const at::Tensor& experts, int64_t inter, int64_t group,
                         int64_t reduction, double threshold, bool renormalize) {
  const at::Tensor h = h_in.contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "moe_layer_int: h must be [1, H]");
  const RoutingTrim trim{reduction, threshold, renormalize};
  const MoeIntLayer L = moe_int_layer(h.size(1), norm_w, router_w, experts, k, inter, group, trim);
  static thread_local MoeIntScratch s;
  at::Tensor y = at::empty({1, L.H}, h.options());
  moe_int_rows(L, bf16_data(h, "h"), (float)eps, k, norm, trim, s, reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY_FRAGMENT(colibri_int, m) {
  m.def("moe_layer_int(Tensor h, Tensor norm_w, float eps, Tensor router_w, int k, bool norm, Tensor experts, "
        "int inter, int group, int reduction=0, float threshold=0., bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) { m.impl("moe_layer_int", &moe_layer_int); }
