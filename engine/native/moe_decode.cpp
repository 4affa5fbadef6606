// One MoE layer of a decode step (T == 1) in one call, for bf16 experts held in RAM, plus the
// pieces it is made of as ops of their own, which the unfused decode path calls.
//
// Why: the layer was ~20 top-level torch operators per token (norm, router matmul, softmax, top-k,
// renormalisation, sort, index, the experts, the weighted sum, the residual add), each a few µs of
// dispatch and Python; a 16-layer model paid ~1,160 operators per token. Here it is one.
//
// Bits: the fused op is made of the same inline functions as the separate ops, in the same order,
// so a layer computed fused (resident store) and unfused (streaming store: experts one at a time
// as their reads land, then combine_bf16) give the same bits; the placement-invariance tests rely
// on it. Versus torch's ops: rms_norm sums the squares in its own order and router probabilities
// use std::exp, so results differ from torch's in the last bits (as every native op does).
//
// Ops (namespace colibri):
//   rms_norm_bf16(x [..., H], w [H], eps) -> like x       w * round(x * rsqrt(mean(x^2) + eps)), per row
//   route_topk_bf16(x [T,H], w [E,H], k, norm) -> (ids [T,k] int64, weights [T,k] bf16)
//       softmax over the bf16 router logits, the k best (ties: lower id), renormalised when norm;
//       each row by itself (row t's bits are the one-row call's on it)
//   combine_bf16(ys [K,H], weights [K]) -> [1,H]           sum_k weights[k] ys[k], in row order;
//       ys [B*K,H] with weights [B,K] -> [B,H]: row b the one-row call on its K slots
//   moe_layer_bf16(h [1,H], norm_w, eps, router_w [E,H], k, norm, experts int64 [E,3], inter, reduction,
//       threshold, renormalize) -> [1,H]
//       h + combine(experts of trim(route(rms_norm(h)))), experts in ascending id order; the trim
//       (moe_kernels.h trim_experts: RoutingTrim.apply's rule and bits; 0, 0 = none); `experts` holds
//       per expert the addresses of its gate [I,H], up [I,H], down [H,I] rows (bf16, contiguous),
//       which the caller keeps alive (engine/arch/moe.py: ResidentMoeLayer holds the tensors).

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "bf16_kernels.h"
#include "moe_bf16.h"
#include "moe_kernels.h"

namespace {

using namespace colibri_native;

at::Tensor rms_norm_bf16(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  const at::Tensor x = x_in.contiguous();
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H, "rms_norm_bf16: w must be [H] for x [..., H]");
  const bf16* xp = bf16_data(x, "x");
  const bf16* wp = bf16_data(w, "w");
  at::Tensor y = at::empty(x.sizes(), x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const int64_t rows = H ? x.numel() / H : 0;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) rms_norm_row(xp + r * H, wp, H, (float)eps, yp + r * H);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> route_topk_bf16(const at::Tensor& x_in, const at::Tensor& w, int64_t k, bool norm) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "route_topk_bf16: x [T,H], w [E,H]");
  const int64_t T = x.size(0), E = w.size(0), H = x.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "route_topk_bf16: k must be in 1..E");
  std::vector<float> probs(E), weights(k);
  at::Tensor ids = at::empty({T, k}, x.options().dtype(at::kLong));
  at::Tensor out = at::empty({T, k}, x.options());
  const bf16 *xp = bf16_data(x, "x"), *wp = bf16_data(w, "w");
  for (int64_t t = 0; t < T; t++) {  // each row the one-row call (a verify's rows, a batched step's)
    route_topk(xp + t * H, wp, E, H, k, norm, probs.data(), ids.data_ptr<int64_t>() + t * k, weights.data());
    for (int64_t j = 0; j < k; j++) store(out, t * k + j, weights[j]);
  }
  return {ids, out};
}

at::Tensor combine_bf16(const at::Tensor& ys_in, const at::Tensor& weights_in) {
  const at::Tensor ys = ys_in.contiguous(), weights = weights_in.contiguous();
  // weights [K] (one row) or [B, K] (B rows, each its own K slots of ys in order)
  const int64_t B = weights.dim() == 2 ? weights.size(0) : 1, K = weights.dim() == 2 ? weights.size(1) : weights.numel();
  TORCH_CHECK(ys.dim() == 2 && weights.dim() <= 2 && ys.size(0) == B * K,
              "combine_bf16: ys [K,H] with weights [K], or ys [B*K,H] with weights [B,K]");
  const int64_t H = ys.size(1);
  const bf16* wp = bf16_data(weights, "weights");
  std::vector<float> w(B * K);
  for (int64_t j = 0; j < B * K; j++) w[j] = to_f32(wp[j]);
  at::Tensor y = at::empty({B, H}, ys.options());
  const bf16* yp = bf16_data(ys, "ys");
  bf16* out = reinterpret_cast<bf16*>(y.data_ptr());
  for (int64_t b = 0; b < B; b++) combine(yp + b * K * H, w.data() + b * K, K, H, out + b * H);
  return y;
}

at::Tensor moe_layer_bf16(const at::Tensor& h_in, const at::Tensor& norm_w, double eps, const at::Tensor& router_w,
                          int64_t k, bool norm, const at::Tensor& experts, int64_t inter, int64_t reduction,
                          double threshold, bool renormalize) {
  const at::Tensor h = h_in.contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "moe_layer_bf16: h must be [1, H]");
  const RoutingTrim trim{reduction, threshold, renormalize};
  const MoeLayer L = moe_layer(h.size(1), norm_w, router_w, experts, k, inter, trim);
  static thread_local MoeScratch scratch;
  at::Tensor y = at::empty({1, L.H}, h.options());
  moe_rows(L, bf16_data(h, "h"), (float)eps, k, norm, trim, scratch, reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

}  // namespace
TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("route_topk_bf16(Tensor x, Tensor w, int k, bool norm) -> (Tensor, Tensor)");
  m.def("combine_bf16(Tensor ys, Tensor weights) -> Tensor");
  m.def("moe_layer_bf16(Tensor h, Tensor norm_w, float eps, Tensor router_w, int k, bool norm, Tensor experts, "
        "int inter, int reduction=0, float threshold=0., bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("route_topk_bf16", &route_topk_bf16);
  m.impl("combine_bf16", &combine_bf16);
  m.impl("moe_layer_bf16", &moe_layer_bf16);
}
