// bf16 matrix-vector products for decode: one token (T == 1), or a batched step's few rows
// (several sequences at once, or a speculative verify's positions), with AVX512-BF16.
//
// Why: at M = 1 torch's bf16 matmul (oneDNN brgemm on this CPU class) reaches 10-17 GB/s of
// weight bandwidth on 2 cores, a quarter of what the memory gives, because the GEMM kernel is
// built for tiles of many rows; decode is a stream of dot products, one per weight row. Here
// each output is one row of W read once with vdpbf16ps (fp32 accumulation) against the input
// row held in cache. With several rows each weight row is read once and dotted with all of them
// (bf16_kernels.h dot_multi): the weights stream once per step, not once per row.
//
// Determinism: every output element is computed by one thread, in one fixed order (two
// accumulators over 32-element blocks, then one horizontal sum), whatever the thread count
// and however the rows are split. So an expert computed alone (streaming: as its read lands)
// and the same expert inside a batched call (resident: all the layer's experts at once) give
// the same bits, which the placement-invariance tests rely on. Rows of x never share an
// accumulation: row m of an M-row call (linear_bf16, experts_rows_bf16) is, bit for bit, what the
// call with that row alone gives, so a sequence decodes the same tokens batched or alone.
//
// Roundings follow the torch ops they replace: the products are rounded to bf16 like the
// outputs of F.linear, SwiGLU's silu and product each round to bf16 like F.silu and `*` on
// bf16 tensors.
//
// Ops (namespace colibri):
//   linear_bf16(x [M,K], w [N,K], bias [N]?) -> [M,N]             y = x @ w.T (+ bias)
//   linear_f32_bf16w(x fp32 [M,K], w bf16 [N,K]) -> fp32 [M,N]     y = x @ w.T in fp32 (the sigmoid routers)
//   route_sigmoid_group_bf16(x [M,H], w bf16 [E,H], bias [E], k, n_group, topk_group, norm, scale)
//       -> (ids [M,k] int64, weights [M,k] bf16)   the sigmoid-group rule (engine/arch/router.py
//       SigmoidGroupRouter) of each row: fp32 logits as linear_f32_bf16w computes them, one call for
//       the M rows instead of ~14 torch ops per row, each row's bits whatever M
//   experts_bf16(x [1,H], weights, per_expert) -> [E,H]           SwiGLU of E experts on x;
//       weights = per expert (gate_up [2I,H], down [H,I]) or (gate [I,H], up [I,H], down [H,I])
//   experts_rows_bf16(x [M,H], weights, per_expert, slot_row int64 [S], slot_expert int64 [S]) -> [S,H]
//       slot s: expert slot_expert[s] (of the E given, as experts_bf16 takes them) on row slot_row[s]
//       of x, bit for bit experts_bf16(x[r:r+1], that expert); the slots sorted by expert (checked)

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "bf16_kernels.h"

namespace {

using namespace colibri_native;

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_bf16: x [M,K], w [N,K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const bf16* xp = bf16_data(x, "x");
  const bf16* wp = bf16_data(w, "w");
  // The bias is added to the fp32 dot before the one rounding, as addmm (F.linear with a bias) rounds.
  at::Tensor bias;
  const bf16* bp = nullptr;
  if (bias_in.has_value() && bias_in->defined()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "linear_bf16: bias must be [N]");
    bp = bf16_data(bias, "bias");
  }
  auto plus_bias = [bp](int64_t n, float v) { return bp ? v + to_f32(bp[n]) : v; };
  at::Tensor y = at::empty({M, N}, x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  if (M == 1) {  // decode: one stream of rows (dot_rows)
    at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
      dot_rows(wp, K, xp, begin, end, [&](int64_t n, float v) { yp[n] = to_bf16(plus_bias(n, v)); });
    });
    return y;
  }
  // Several rows (batched decode): each weight row read once and dotted with every row of x (four of x
  // at a time in registers, two weight rows where the matrix is small: dot_rows_many), n outer, m
  // inner; each output is dot()'s bits for that row, as a call with the row alone gives.
  std::vector<const bf16*> xs(M);
  for (int64_t m = 0; m < M; m++) xs[m] = xp + m * K;
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    dot_rows_many(wp, N, K, xs.data(), M, begin, end,
                  [&](int64_t m, int64_t n, float v) { yp[m * N + n] = to_bf16(plus_bias(n, v)); });
  });
  return y;
}

// fp32 x [M,K] against bf16 rows w [N,K] -> fp32 [M,N]: the sigmoid routers' logits (deepseek_v3,
// glm4_moe, glm_moe_dsa), whose math is fp32 whatever the compute dtype (with 256 experts bf16 logits
// would tie). Why: F.linear(x.float(), w.float()) converted the whole router weight to fp32 on every
// call, a copy twice the weight's size per MoE layer per token (and per lookahead guess). Here each
// weight row is widened in registers (bf16 -> fp32 is exact) and dotted in fp32: sixteen lanes, one
// fused multiply-add per element in ascending k, one horizontal sum. Each output is computed by one
// thread in that fixed order, whatever M and however the rows are split: row m of an M-row call is,
// bit for bit, the call with that row alone (a verify's rows route as each would alone).
inline float dot_f32_bf16(const bf16* w, const float* x, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + k))), 16);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(wide), _mm512_loadu_ps(x + k), acc);
  }
  if (k < K) {
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w + k)), 16);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(wide), _mm512_maskz_loadu_ps(mask, x + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

at::Tensor linear_f32_bf16w(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_f32_bf16w: x [M,K], w [N,K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "linear_f32_bf16w: x must be fp32 on the CPU");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const float* xp = x.data_ptr<float>();
  const bf16* wp = bf16_data(w, "w");
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t m = 0; m < M; m++) yp[m * N + n] = dot_f32_bf16(wp + n * K, xp + m * K, K);
  });
  return y;
}

// The sigmoid-group routing rule (DeepSeek-V3, GLM-4.5/5) of each of x's M rows, in fp32:
//   scores = sigmoid(x @ w.T); choice = scores + bias (the bias shifts the choice, never the weight);
//   the E experts in n_group groups, each scored by the sum of its two best choices; the topk_group
//   best groups compete; the k best choices among them (ties: the lower id) → ids; their scores →
//   weights, renormalised (sum in that order + 1e-20) when norm, times scale, rounded to bf16.
// Why native: torch took ~14 ops per row for this (sigmoid, topk twice, scatter, masks, gather, sum),
// ~50 µs of dispatch a row and layer; a verify or a batched step routes many rows. Each row is
// computed alone in a fixed order, so a row has the same bits in a call of M rows as alone (a
// speculative verify's rows are their solo decode steps).
std::tuple<at::Tensor, at::Tensor> route_sigmoid_group_bf16(const at::Tensor& x_in, const at::Tensor& w,
                                                            const at::Tensor& bias_in, int64_t k, int64_t n_group,
                                                            int64_t topk_group, bool norm, double scale) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "route_sigmoid_group_bf16: x [M,H], w [E,H]");
  const int64_t M = x_in.size(0), E = w.size(0), H = w.size(1);
  TORCH_CHECK(bias_in.numel() == E, "route_sigmoid_group_bf16: bias must be [E]");
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && E / n_group >= 2 && topk_group >= 1 && topk_group <= n_group,
              "route_sigmoid_group_bf16: E must split into n_group groups of 2 or more, topk_group in 1..n_group");
  TORCH_CHECK(k >= 1 && k <= (E / n_group) * topk_group, "route_sigmoid_group_bf16: k must be in 1..the experts of topk_group groups");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // x.float(), as fp32_logits widens it
  const at::Tensor bias = bias_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const bf16* wp = bf16_data(w, "w");
  std::vector<float> logits(M * E);
  at::parallel_for(0, E, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; e++)
      for (int64_t m = 0; m < M; m++) logits[m * E + e] = dot_f32_bf16(wp + e * H, xp + m * H, H);
  });
  at::Tensor ids = at::empty({M, k}, x_in.options().dtype(at::kLong));
  at::Tensor weights = at::empty({M, k}, x_in.options().dtype(at::kBFloat16));
  int64_t* ip = ids.data_ptr<int64_t>();
  bf16* op = reinterpret_cast<bf16*>(weights.data_ptr());
  const int64_t per = E / n_group;
  std::vector<float> scores(E), choice(E), group(n_group), chosen(k);
  std::vector<char> open(n_group);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t e = 0; e < E; e++) {
      scores[e] = 1.0f / (1.0f + std::exp(-logits[m * E + e]));
      choice[e] = scores[e] + bp[e];
    }
    for (int64_t g = 0; g < n_group; g++) {  // the sum of the group's two best choices
      float a = -INFINITY, b = -INFINITY;
      for (int64_t e = g * per; e < (g + 1) * per; e++) {
        const float c = choice[e];
        if (c > a) b = a, a = c;
        else if (c > b) b = c;
      }
      group[g] = a + b;
      open[g] = 0;
    }
    for (int64_t j = 0; j < topk_group; j++) {  // the best groups (ties: the lower index)
      int64_t best = -1;
      for (int64_t g = 0; g < n_group; g++)
        if (!open[g] && (best < 0 || group[g] > group[best])) best = g;
      open[best] = 1;
    }
    float total = 0.0f;
    int64_t* row_ids = ip + m * k;
    for (int64_t j = 0; j < k; j++) {  // the k best choices in the open groups (ties: the lower id)
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++) {
        if (!open[e / per] || std::isnan(choice[e])) continue;
        if (best < 0 || choice[e] > choice[best]) best = e;
      }
      TORCH_CHECK(best >= 0, "route_sigmoid_group_bf16: fewer than k experts to choose from (NaN scores)");
      row_ids[j] = best;
      chosen[j] = scores[best];
      total += scores[best];
      choice[best] = NAN;  // taken
    }
    for (int64_t j = 0; j < k; j++) {
      const float v = norm ? chosen[j] / (total + 1e-20f) : chosen[j];
      op[m * k + j] = to_bf16(v * (float)scale);
    }
  }
  return {ids, weights};
}

// Each expert's gate, up and down rows from the op's weights (per expert (gate_up, down) or (gate, up,
// down)), checked: all experts [I, H] / [H, I] of one I. Returns I.
int64_t expert_rows(at::TensorList weights, int64_t per_expert, int64_t H, const char* op, std::vector<const bf16*>& gate,
                    std::vector<const bf16*>& up, std::vector<const bf16*>& down) {
  TORCH_CHECK(per_expert == 2 || per_expert == 3, op, ": 2 or 3 weights per expert");
  TORCH_CHECK(weights.size() > 0 && weights.size() % per_expert == 0, op, ": weights come per expert");
  const int64_t E = weights.size() / per_expert;
  const at::Tensor& down0 = weights[per_expert - 1];
  TORCH_CHECK(down0.dim() == 2 && down0.size(0) == H, op, ": down must be [H, I]");
  const int64_t I = down0.size(1);
  gate.resize(E), up.resize(E), down.resize(E);
  for (int64_t e = 0; e < E; e++) {
    const at::Tensor* w = &weights[e * per_expert];
    const at::Tensor& d = w[per_expert - 1];
    TORCH_CHECK(d.dim() == 2 && d.size(0) == H && d.size(1) == I, op, ": down must be [H, I]");
    down[e] = bf16_data(d, "down");
    if (per_expert == 2) {
      TORCH_CHECK(w[0].dim() == 2 && w[0].size(0) == 2 * I && w[0].size(1) == H, op, ": gate_up must be [2I, H]");
      gate[e] = bf16_data(w[0], "gate_up");
      up[e] = gate[e] + I * H;
    } else {
      for (int j = 0; j < 2; j++)
        TORCH_CHECK(w[j].dim() == 2 && w[j].size(0) == I && w[j].size(1) == H, op, ": gate/up must be [I, H]");
      gate[e] = bf16_data(w[0], "gate");
      up[e] = bf16_data(w[1], "up");
    }
  }
  return I;
}

at::Tensor experts_bf16(const at::Tensor& x_in, at::TensorList weights, int64_t per_expert) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "experts_bf16: x must be [1, H]");
  const int64_t H = x.size(1);
  std::vector<const bf16*> gate, up, down;
  const int64_t I = expert_rows(weights, per_expert, H, "experts_bf16", gate, up, down);
  const int64_t E = gate.size();
  const bf16* xp = bf16_data(x, "x");
  at::Tensor h = at::empty({E, I}, x.options());  // silu(gate x) * (up x), per expert
  at::Tensor y = at::empty({E, H}, x.options());
  swiglu_experts(xp, gate.data(), up.data(), down.data(), E, H, I, reinterpret_cast<bf16*>(h.data_ptr()),
                 reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

at::Tensor experts_rows_bf16(const at::Tensor& x_in, at::TensorList weights, int64_t per_expert,
                             const at::Tensor& slot_row_in, const at::Tensor& slot_expert_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2, "experts_rows_bf16: x must be [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  std::vector<const bf16*> gate, up, down;
  const int64_t I = expert_rows(weights, per_expert, H, "experts_rows_bf16", gate, up, down);
  const int64_t E = gate.size();
  const at::Tensor slot_row = slot_row_in.contiguous(), slot_expert = slot_expert_in.contiguous();
  TORCH_CHECK(slot_row.scalar_type() == at::kLong && slot_expert.scalar_type() == at::kLong && slot_row.dim() == 1 &&
                  slot_expert.sizes() == slot_row.sizes() && slot_row.device().is_cpu() && slot_expert.device().is_cpu(),
              "experts_rows_bf16: slot_row and slot_expert must be int64 [S] CPU tensors");
  const int64_t S = slot_row.size(0);
  const int64_t *row = slot_row.data_ptr<int64_t>(), *expert = slot_expert.data_ptr<int64_t>();
  const bf16* xp = bf16_data(x, "x");
  std::vector<const bf16*> xs(S);
  std::vector<int64_t> ex, first;  // the experts with slots, and where each one's slots begin
  for (int64_t s = 0; s < S; s++) {
    TORCH_CHECK(row[s] >= 0 && row[s] < M, "experts_rows_bf16: slot_row[", s, "] = ", row[s], " is not a row of x");
    TORCH_CHECK(expert[s] >= 0 && expert[s] < E, "experts_rows_bf16: slot_expert[", s, "] = ", expert[s],
                " is not one of the ", E, " experts");
    TORCH_CHECK(s == 0 || expert[s] >= expert[s - 1], "experts_rows_bf16: the slots must be sorted by expert");
    if (s == 0 || expert[s] != expert[s - 1]) ex.push_back(expert[s]), first.push_back(s);
    xs[s] = xp + row[s] * H;
  }
  first.push_back(S);
  at::Tensor h = at::empty({S, I}, x.options());  // silu(gate x) * (up x), per slot
  at::Tensor y = at::empty({S, H}, x.options());
  swiglu_slots(xs.data(), gate.data(), up.data(), down.data(), ex.data(), first.data(), (int64_t)ex.size(), H, I,
               reinterpret_cast<bf16*>(h.data_ptr()), reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

}  // namespace

TORCH_LIBRARY(colibri, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("linear_f32_bf16w(Tensor x, Tensor w) -> Tensor");
  m.def("route_sigmoid_group_bf16(Tensor x, Tensor w, Tensor bias, int k, int n_group, int topk_group, bool norm, "
        "float scale) -> (Tensor, Tensor)");
  m.def("experts_bf16(Tensor x, Tensor[] weights, int per_expert) -> Tensor");
  m.def("experts_rows_bf16(Tensor x, Tensor[] weights, int per_expert, Tensor slot_row, Tensor slot_expert) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_f32_bf16w", &linear_f32_bf16w);
  m.impl("route_sigmoid_group_bf16", &route_sigmoid_group_bf16);
  m.impl("experts_bf16", &experts_bf16);
  m.impl("experts_rows_bf16", &experts_rows_bf16);
}
