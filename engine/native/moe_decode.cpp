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
//   route_topk_bf16(x [1,H], w [E,H], k, norm) -> (ids [1,k] int64, weights [1,k] bf16)
//       softmax over the bf16 router logits, the k best (ties: lower id), renormalised when norm
//   combine_bf16(ys [K,H], weights [K]) -> [1,H]           sum_k weights[k] ys[k], in row order
//   moe_layer_bf16(h [1,H], norm_w, eps, router_w [E,H], k, norm, experts int64 [E,3], inter) -> [1,H]
//       h + combine(experts of route(rms_norm(h))), experts in ascending id order; `experts` holds
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
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w.dim() == 2 && w.size(1) == x.size(1),
              "route_topk_bf16: x [1,H], w [E,H]");
  const int64_t E = w.size(0), H = x.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "route_topk_bf16: k must be in 1..E");
  std::vector<float> probs(E), weights(k);
  at::Tensor ids = at::empty({1, k}, x.options().dtype(at::kLong));
  route_topk(bf16_data(x, "x"), bf16_data(w, "w"), E, H, k, norm, probs.data(), ids.data_ptr<int64_t>(),
             weights.data());
  at::Tensor out = at::empty({1, k}, x.options());
  for (int64_t j = 0; j < k; j++) store(out, j, weights[j]);
  return {ids, out};
}

at::Tensor combine_bf16(const at::Tensor& ys_in, const at::Tensor& weights_in) {
  const at::Tensor ys = ys_in.contiguous(), weights = weights_in.contiguous();
  TORCH_CHECK(ys.dim() == 2 && weights.numel() == ys.size(0), "combine_bf16: ys [K,H], weights [K]");
  const int64_t K = ys.size(0), H = ys.size(1);
  const bf16* wp = bf16_data(weights, "weights");
  std::vector<float> w(K);
  for (int64_t j = 0; j < K; j++) w[j] = to_f32(wp[j]);
  at::Tensor y = at::empty({1, H}, ys.options());
  combine(bf16_data(ys, "ys"), w.data(), K, H, reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

// Per calling thread, reused across calls: no allocation per token but the output.
struct Scratch {
  std::vector<bf16> normed, h;
  std::vector<float> probs, weights;
  std::vector<int64_t> ids;
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<const bf16*> gate, up, down;
};

at::Tensor moe_layer_bf16(const at::Tensor& h_in, const at::Tensor& norm_w, double eps, const at::Tensor& router_w,
                          int64_t k, bool norm, const at::Tensor& experts, int64_t inter) {
  const at::Tensor h = h_in.contiguous();
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "moe_layer_bf16: h must be [1, H]");
  const int64_t H = h.size(1), E = router_w.size(0), I = inter;
  TORCH_CHECK(router_w.dim() == 2 && router_w.size(1) == H, "moe_layer_bf16: router_w must be [E, H]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == H, "moe_layer_bf16: norm_w must be [H]");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == E &&
              experts.size(1) == 3 && experts.is_contiguous(), "moe_layer_bf16: experts must be int64 [E, 3]");
  TORCH_CHECK(k >= 1 && k <= E && I >= 1, "moe_layer_bf16: k in 1..E, inter >= 1");
  const bf16* hp = bf16_data(h, "h");
  const bf16* rw = bf16_data(router_w, "router_w");
  const bf16* nw = bf16_data(norm_w, "norm_w");
  static thread_local Scratch scratch;
  Scratch& s = scratch;  // the caller's: the region's threads share it (a thread_local named there is theirs)
  s.normed.resize(H), s.h.resize(k * I), s.probs.resize(E), s.weights.resize(k), s.ids.resize(k);
  s.chosen.resize(k), s.gate.resize(k), s.up.resize(k), s.down.resize(k);
  rms_norm_row(hp, nw, H, (float)eps, s.normed.data());
  at::Tensor y = at::empty({1, H}, h.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const bf16* x = s.normed.data();
  const int64_t* table = experts.data_ptr<int64_t>();
  const int64_t P = gate_up_units(I);
  // One parallel region for the layer (router | top-k | gate/up | down + combine + residual), split
  // statically: three barriers where separate ops paid a fork and join each. Every value is made
  // by the row functions the separate ops use, in their order, so the bits are theirs.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    thread_share(E, 4, t, T, b, e);
    router_rows(x, rw, H, b, e, s.probs.data());
#pragma omp barrier
#pragma omp single
    {  // (the single's implicit barrier publishes the chosen experts)
      select_topk(s.probs.data(), E, k, norm, s.ids.data(), s.weights.data());
      // Ascending id order, as the unfused path sums (moe.routed_decode sorts the ids).
      auto& chosen = s.chosen;
      for (int64_t j = 0; j < k; j++) chosen[j] = {s.ids[j], round_bf16(s.weights[j])};  // bf16 there
      std::sort(chosen.begin(), chosen.end());
      for (int64_t j = 0; j < k; j++) {
        const int64_t* row = table + 3 * chosen[j].first;
        s.gate[j] = reinterpret_cast<const bf16*>(row[0]);
        s.up[j] = reinterpret_cast<const bf16*>(row[1]);
        s.down[j] = reinterpret_cast<const bf16*>(row[2]);
        s.weights[j] = chosen[j].second;
      }
    }
    thread_share(k * P, 1, t, T, b, e);
    gate_up_rows(x, s.gate.data(), s.up.data(), H, I, b, e, s.h.data());
#pragma omp barrier
    // Output rows n: every expert's down row n (bf16, as experts_bf16 stores it), summed in expert
    // order as combine() sums, rounded, then the residual add.
    thread_share(H, 4, t, T, b, e);
    float acc[4], o[4];
    for (int64_t n = b; n < e; n += 4) {
      const int64_t rows = std::min<int64_t>(4, e - n);
      std::fill(acc, acc + 4, 0.0f);
      for (int64_t j = 0; j < k; j++) {
        const bf16* d = s.down[j] + n * I;
        const bf16* hj = s.h.data() + j * I;
        if (rows == 4)
          dot4(d, d + I, d + 2 * I, d + 3 * I, hj, I, o);
        else
          for (int64_t r = 0; r < rows; r++) o[r] = dot(d + r * I, hj, I);
        for (int64_t r = 0; r < rows; r++) acc[r] += s.weights[j] * round_bf16(o[r]);
      }
      for (int64_t r = 0; r < rows; r++) yp[n + r] = to_bf16(to_f32(hp[n + r]) + round_bf16(acc[r]));
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("route_topk_bf16(Tensor x, Tensor w, int k, bool norm) -> (Tensor, Tensor)");
  m.def("combine_bf16(Tensor ys, Tensor weights) -> Tensor");
  m.def("moe_layer_bf16(Tensor h, Tensor norm_w, float eps, Tensor router_w, int k, bool norm, Tensor experts, "
        "int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("route_topk_bf16", &route_topk_bf16);
  m.impl("combine_bf16", &combine_bf16);
  m.impl("moe_layer_bf16", &moe_layer_bf16);
}
