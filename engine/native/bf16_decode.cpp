// bf16 matrix-vector products for one decode token (T == 1), with AVX512-BF16.
//
// Why: at M = 1 torch's bf16 matmul (oneDNN brgemm on this CPU class) reaches 10-17 GB/s of
// weight bandwidth on 2 cores, a quarter of what the memory gives, because the GEMM kernel is
// built for tiles of many rows; decode is a stream of dot products, one per weight row. Here
// each output is one row of W read once with vdpbf16ps (fp32 accumulation) against the input
// row held in cache.
//
// Determinism: every output element is computed by one thread, in one fixed order (two
// accumulators over 32-element blocks, then one horizontal sum), whatever the thread count
// and however the rows are split. So an expert computed alone (streaming: as its read lands)
// and the same expert inside a batched call (resident: all the layer's experts at once) give
// the same bits, which the placement-invariance tests rely on.
//
// Roundings follow the torch ops they replace: the products are rounded to bf16 like the
// outputs of F.linear, SwiGLU's silu and product each round to bf16 like F.silu and `*` on
// bf16 tensors.
//
// Ops (namespace colibri):
//   linear_bf16(x [M,K], w [N,K]) -> [M,N]                        y = x @ w.T
//   experts_bf16(x [1,H], weights, per_expert) -> [E,H]           SwiGLU of E experts on x;
//       weights = per expert (gate_up [2I,H], down [H,I]) or (gate [I,H], up [I,H], down [H,I])

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_kernels.h"

namespace {

using namespace colibri_native;

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_bf16: x [M,K], w [N,K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const bf16* xp = bf16_data(x, "x");
  const bf16* wp = bf16_data(w, "w");
  at::Tensor y = at::empty({M, N}, x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m++)
      dot_rows(wp, K, xp + m * K, begin, end, [&](int64_t n, float v) { yp[m * N + n] = to_bf16(v); });
  });
  return y;
}

at::Tensor experts_bf16(const at::Tensor& x_in, at::TensorList weights, int64_t per_expert) {
  TORCH_CHECK(per_expert == 2 || per_expert == 3, "experts_bf16: 2 or 3 weights per expert");
  TORCH_CHECK(weights.size() > 0 && weights.size() % per_expert == 0, "experts_bf16: weights come per expert");
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "experts_bf16: x must be [1, H]");
  const int64_t E = weights.size() / per_expert, H = x.size(1);
  const at::Tensor& down0 = weights[per_expert - 1];
  TORCH_CHECK(down0.dim() == 2 && down0.size(0) == H, "experts_bf16: down must be [H, I]");
  const int64_t I = down0.size(1);
  std::vector<const bf16*> gate(E), up(E), down(E);
  for (int64_t e = 0; e < E; e++) {
    const at::Tensor* w = &weights[e * per_expert];
    const at::Tensor& d = w[per_expert - 1];
    TORCH_CHECK(d.dim() == 2 && d.size(0) == H && d.size(1) == I, "experts_bf16: down must be [H, I]");
    down[e] = bf16_data(d, "down");
    if (per_expert == 2) {
      TORCH_CHECK(w[0].dim() == 2 && w[0].size(0) == 2 * I && w[0].size(1) == H, "experts_bf16: gate_up must be [2I, H]");
      gate[e] = bf16_data(w[0], "gate_up");
      up[e] = gate[e] + I * H;
    } else {
      for (int j = 0; j < 2; j++)
        TORCH_CHECK(w[j].dim() == 2 && w[j].size(0) == I && w[j].size(1) == H, "experts_bf16: gate/up must be [I, H]");
      gate[e] = bf16_data(w[0], "gate");
      up[e] = bf16_data(w[1], "up");
    }
  }
  const bf16* xp = bf16_data(x, "x");
  at::Tensor h = at::empty({E, I}, x.options());  // silu(gate x) * (up x), per expert
  at::Tensor y = at::empty({E, H}, x.options());
  swiglu_experts(xp, gate.data(), up.data(), down.data(), E, H, I, reinterpret_cast<bf16*>(h.data_ptr()),
                 reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

}  // namespace

TORCH_LIBRARY(colibri, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("experts_bf16(Tensor x, Tensor[] weights, int per_expert) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("experts_bf16", &experts_bf16);
}
