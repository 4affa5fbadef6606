// The fused bf16 MoE layer of one decode token as inline functions: the op of moe_decode.cpp and
// the whole-step loop of decode_step.cpp both run moe_rows, so a layer gives the same bits either
// way, and the same bits as the separate ops (it is made of their row functions, in their order).
#pragma once

#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_kernels.h"
#include "moe_kernels.h"

namespace colibri_native {

// One layer's MoE operands as raw rows (checked once by moe_layer): `table` holds per expert the
// addresses of its gate [I,H], up [I,H], down [H,I] rows (bf16, contiguous), kept alive by the caller.
struct MoeLayer {
  const bf16 *norm_w, *router_w;
  const int64_t* table;
  int64_t E, H, I;
};

inline MoeLayer moe_layer(int64_t H, const at::Tensor& norm_w, const at::Tensor& router_w, const at::Tensor& experts,
                          int64_t k, int64_t inter, const RoutingTrim& trim) {
  const int64_t E = router_w.size(0);
  TORCH_CHECK(router_w.dim() == 2 && router_w.size(1) == H, "moe_layer_bf16: router_w must be [E, H]");
  TORCH_CHECK(norm_w.dim() == 1 && norm_w.size(0) == H, "moe_layer_bf16: norm_w must be [H]");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == E &&
              experts.size(1) == 3 && experts.is_contiguous(), "moe_layer_bf16: experts must be int64 [E, 3]");
  TORCH_CHECK(k >= 1 && k <= E && inter >= 1, "moe_layer_bf16: k in 1..E, inter >= 1");
  check_trim(trim, k, "moe_layer_bf16");
  return {bf16_data(norm_w, "norm_w"), bf16_data(router_w, "router_w"), experts.data_ptr<int64_t>(), E, H, inter};
}

// Per calling thread, reused across calls: no allocation per token but the output.
struct MoeScratch {
  std::vector<bf16> normed, h, ys;
  std::vector<float> probs, weights;
  std::vector<int64_t> ids;
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<const bf16*> gate, up, down;
  int64_t kept = 0;  // experts the token uses (k, or fewer under a routing trim)
};

// y = h + combine(experts of trim(route(rms_norm(h)))) [H], experts in ascending id order. h, y may not alias.
inline void moe_rows(const MoeLayer& L, const bf16* hp, float eps, int64_t k, bool norm, const RoutingTrim& trim,
                     MoeScratch& s, bf16* yp) {
  const int64_t E = L.E, H = L.H, I = L.I;
  const bf16 *rw = L.router_w, *nw = L.norm_w;
  s.normed.resize(H), s.h.resize(k * I), s.ys.resize(k * H), s.probs.resize(E), s.weights.resize(k), s.ids.resize(k);
  s.gate.resize(k), s.up.resize(k), s.down.resize(k);
  rms_norm_row(hp, nw, H, eps, s.normed.data());
  const bf16* x = s.normed.data();
  const int64_t* table = L.table;
  // One parallel region for the layer (router | top-k | gate/up | down + combine + residual), split
  // statically: three barriers where separate ops paid a fork and join each. Every value is made
  // by the row functions the separate ops use, in their order, so the bits are theirs.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    thread_share(E, t, T, b, e);
    router_rows(x, rw, H, b, e, s.probs.data());
#pragma omp barrier
#pragma omp single
    {  // (the single's implicit barrier publishes the chosen experts)
      select_topk(s.probs.data(), E, k, norm, s.ids.data(), s.weights.data());
      s.kept = trim_experts(trim, k, s.ids.data(), s.weights.data());
      ascending_experts(s.ids.data(), s.weights.data(), s.kept, s.chosen);
      const auto& chosen = s.chosen;
      for (int64_t j = 0; j < s.kept; j++) {
        const int64_t* row = table + 3 * chosen[j].first;
        s.gate[j] = reinterpret_cast<const bf16*>(row[0]);
        s.up[j] = reinterpret_cast<const bf16*>(row[1]);
        s.down[j] = reinterpret_cast<const bf16*>(row[2]);
        s.weights[j] = chosen[j].second;
      }
    }
    const int64_t kept = s.kept;
    thread_share(kept * I, t, T, b, e);
    gate_up_rows(x, s.gate.data(), s.up.data(), H, I, b, e, s.h.data());
#pragma omp barrier
    // Output rows [b, e) of this thread: each expert's down rows there as one stream (bf16, as
    // experts_bf16 stores them), then per row the sum in expert order as combine() sums, rounded,
    // and the residual add.
    thread_share(H, t, T, b, e);
    bf16* ys = s.ys.data();
    for (int64_t j = 0; j < kept; j++) {
      const bf16* hj = s.h.data() + j * I;
      dot_rows(s.down[j], I, hj, b, e, [&](int64_t n, float v) { ys[j * H + n] = to_bf16(v); });
    }
    for (int64_t n = b; n < e; n++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < kept; j++) acc += s.weights[j] * to_f32(ys[j * H + n]);
      yp[n] = to_bf16(to_f32(hp[n]) + round_bf16(acc));
    }
  }
}


// Per calling thread, reused across calls (moe_batch's): every buffer sized by M rows once.
struct MoeBatchScratch {
  std::vector<bf16> normed, h, ys;        // normed [M, H], h [S, I], ys [S, H]
  std::vector<float> probs, weights;      // probs [M, E]; weights [M, k]: row r's j-th expert (ascending id)
  std::vector<int64_t> ids, experts, kept, row_slot;  // ids [M, k]; experts [M, k]; row_slot [M, k]: its slot
  std::vector<std::pair<int64_t, float>> chosen;
  std::vector<std::pair<int64_t, int64_t>> order;  // (expert, row * k + j): the slots sorted by expert
  std::vector<const bf16*> rows, xs, hs, gate, up, down;  // normed rows; per slot its row; per union expert
  std::vector<int64_t> first;             // the union's slots: expert a takes [first[a], first[a + 1])
};

// moe_rows for M rows at once, each its own token (a batched step's sequences, or a verify's
// positions): y[r] = h[r] + combine(experts of trim(route(rms_norm(h[r])))), every row bit for bit
// moe_rows on that row alone. The weights are read once for all rows: each router row and each weight
// row of an expert in the union of the rows' routes meets every row (or slot) that needs it while in
// registers (dot_rows_many / dot_many2: a row's own accumulators, dot()'s bits); the combine runs per
// row over its experts in ascending id order with moe_rows' roundings. One parallel region, as moe_rows: router
// rows | (single) each row's top-k, trim and order, the union's slots | gate/up rows of the union |
// down rows, then each row's combine and residual add. h[r], y[r] may not alias.
inline void moe_batch(const MoeLayer& L, const bf16* const* hp, int64_t M, float eps, int64_t k, bool norm,
                      const RoutingTrim& trim, MoeBatchScratch& s, bf16* const* yp) {
  const int64_t E = L.E, H = L.H, I = L.I;
  const bf16 *rw = L.router_w, *nw = L.norm_w;
  s.normed.resize(M * H), s.probs.resize(M * E), s.weights.resize(M * k), s.ids.resize(M * k);
  s.experts.resize(M * k), s.kept.resize(M), s.row_slot.resize(M * k), s.rows.resize(M);
  s.h.resize(M * k * I), s.ys.resize(M * k * H), s.xs.resize(M * k), s.hs.resize(M * k);
  s.gate.resize(M * k), s.up.resize(M * k), s.down.resize(M * k), s.first.resize(M * k + 1);
  for (int64_t r = 0; r < M; r++) {
    rms_norm_row(hp[r], nw, H, eps, s.normed.data() + r * H);
    s.rows[r] = s.normed.data() + r * H;
  }
  const int64_t* table = L.table;
  int64_t A = 0;  // experts in the union (set in the single)
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    float gd[4], ud[4];
    thread_share(E, t, T, b, e);
    // router logits: router_rows' rounding, each router row read once
    dot_rows_many(rw, E, H, s.rows.data(), M, b, e,
                  [&](int64_t r, int64_t n, float v) { s.probs[r * E + n] = round_bf16(v); });
#pragma omp barrier
#pragma omp single
    {  // per row moe_rows' choice; then the slots (row, expert) sorted by expert, rows ascending within one
      s.order.clear();
      for (int64_t r = 0; r < M; r++) {
        int64_t* ids = s.ids.data() + r * k;
        float* w = s.weights.data() + r * k;
        select_topk(s.probs.data() + r * E, E, k, norm, ids, w);
        s.kept[r] = trim_experts(trim, k, ids, w);
        ascending_experts(ids, w, s.kept[r], s.chosen);
        for (int64_t j = 0; j < s.kept[r]; j++) {
          s.experts[r * k + j] = s.chosen[j].first, w[j] = s.chosen[j].second;
          s.order.push_back({s.chosen[j].first, r * k + j});
        }
      }
      std::sort(s.order.begin(), s.order.end());
      A = 0;
      for (int64_t slot = 0; slot < (int64_t)s.order.size(); slot++) {
        const auto [expert, rj] = s.order[slot];
        if (slot == 0 || expert != s.order[slot - 1].first) {
          const int64_t* row = table + 3 * expert;
          s.gate[A] = reinterpret_cast<const bf16*>(row[0]);
          s.up[A] = reinterpret_cast<const bf16*>(row[1]);
          s.down[A] = reinterpret_cast<const bf16*>(row[2]);
          s.first[A++] = slot;
        }
        s.row_slot[rj] = slot;
        s.xs[slot] = s.rows[rj / k];
        s.hs[slot] = s.h.data() + slot * I;
      }
      s.first[A] = (int64_t)s.order.size();
    }
    // Gate/up rows of the union split by work, not by rows: row i of expert a costs its slot count
    // n_a, so the work is S * I in all and the row starts at I * first[a] + i * n_a; this thread
    // takes the rows that start in its share of the work (an expert many rows route to is split
    // over the threads as a one-row expert is). Which thread computes a value changes no bits.
    thread_share(s.first[A] * I, t, T, b, e);
    const bool pair = pair_rows(I, H);  // the gate and up matrices [I, H]
    for (int64_t a = 0; a < A; a++) {  // gate/up row i of union expert a, against each of its slots
      const int64_t s0a = s.first[a], s1 = s.first[a + 1], n = s1 - s0a, base = I * s0a;
      const int64_t i0 = std::clamp<int64_t>((b - base + n - 1) / n, 0, I);  // rows starting in [b, e)
      const int64_t i1 = std::clamp<int64_t>((e - base + n - 1) / n, 0, I);
      for (int64_t i = i0; i < i1; i++) {
        const bf16 *g = s.gate[a] + i * H, *u = s.up[a] + i * H;
        for (int64_t s0 = s0a; s0 < s1; s0 += 4) {
          const int64_t c = std::min<int64_t>(4, s1 - s0);
          dot_many2(g, u, s.xs.data() + s0, c, H, gd, ud, pair);  // the gate and up rows side by side
          for (int64_t j = 0; j < c; j++) s.h[(s0 + j) * I + i] = swiglu_value(gd[j], ud[j]);
        }
      }
    }
#pragma omp barrier
    // Output rows [b, e) of this thread: each union expert's down rows there as one stream (bf16, as
    // moe_rows stores them), then per token row its sum in ascending expert order and the residual.
    thread_share(H, t, T, b, e);
    bf16* ys = s.ys.data();
    for (int64_t a = 0; a < A; a++) {
      const int64_t s0 = s.first[a];
      dot_rows_many(s.down[a], H, I, s.hs.data() + s0, s.first[a + 1] - s0, b, e,
                    [&](int64_t j, int64_t n, float v) { ys[(s0 + j) * H + n] = to_bf16(v); });
    }
    for (int64_t r = 0; r < M; r++) {
      const int64_t kept = s.kept[r];
      const float* w = s.weights.data() + r * k;
      const int64_t* slot = s.row_slot.data() + r * k;
      for (int64_t n = b; n < e; n++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < kept; j++) acc += w[j] * to_f32(ys[slot[j] * H + n]);
        yp[r][n] = to_bf16(to_f32(hp[r][n]) + round_bf16(acc));
      }
    }
  }
}

}  // namespace colibri_native
