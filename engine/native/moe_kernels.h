// The pieces of a decode-step MoE layer that do not depend on how the experts are stored: the
// RMS norm of the token, softmax top-k routing over bf16 router logits, and the weighted combine
// of the chosen experts' outputs. Header-only (inline), shared by the fused layers (bf16 experts in
// moe_decode.cpp; quantized experts beside them) and by the separate ops the streaming path calls,
// so a layer fused or unfused gives the same bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "bf16_kernels.h"

namespace colibri_native {

// One row: w * round_bf16(x * rsqrt(mean(x^2) + eps)), rounded; squares summed in fp32, in order.
inline void rms_norm_row(const bf16* x, const bf16* w, int64_t H, float eps, bf16* out) {
  float ss = 0.0f;
  for (int64_t i = 0; i < H; i++) {
    const float v = to_f32(x[i]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / (float)H + eps);
  for (int64_t i = 0; i < H; i++) out[i] = to_bf16(to_f32(w[i]) * round_bf16(to_f32(x[i]) * r));
}

// Softmax over E router logits (in probs, bf16 values), then the k best: ids and weights in
// descending weight order (ties: the lower id), as torch.topk gives them. probs is overwritten.
inline void select_topk(float* probs, int64_t E, int64_t k, bool norm, int64_t* ids, float* weights) {
  float m = probs[0];
  for (int64_t e = 1; e < E; e++) m = std::max(m, probs[e]);
  float s = 0.0f;
  for (int64_t e = 0; e < E; e++) {
    probs[e] = std::exp(probs[e] - m);
    s += probs[e];
  }
  for (int64_t e = 0; e < E; e++) probs[e] /= s;
  float total = 0.0f;
  for (int64_t j = 0; j < k; j++) {  // k passes over E: k and E are small (8 of 64..256)
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++) {
      if (probs[e] < 0.0f) continue;  // taken
      if (best < 0 || probs[e] > probs[best]) best = e;
    }
    ids[j] = best;
    weights[j] = probs[best];
    total += probs[best];
    probs[best] = -1.0f;
  }
  if (norm)
    for (int64_t j = 0; j < k; j++) weights[j] /= total;
}

// Router logits rows [begin, end) of w [E, H] on x, rounded to bf16 as linear_bf16 rounds them.
inline void router_rows(const bf16* x, const bf16* w, int64_t H, int64_t begin, int64_t end, float* probs) {
  dot_rows(w, H, x, begin, end, [&](int64_t e, float v) { probs[e] = round_bf16(v); });
}

// Router logits, softmax in fp32, the k best (select_topk).
inline void route_topk(const bf16* x, const bf16* w, int64_t E, int64_t H, int64_t k, bool norm,
                       float* probs, int64_t* ids, float* weights) {
  at::parallel_for(0, E, GRAIN, [&](int64_t begin, int64_t end) { router_rows(x, w, H, begin, end, probs); });
  select_topk(probs, E, k, norm, ids, weights);
}

// out[n] = sum over k (in row order) of weights[k] * ys[k, n], fp32, rounded once.
inline void combine(const bf16* ys, const float* weights, int64_t K, int64_t H, bf16* out) {
  at::parallel_for(0, H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++) {
      float acc = 0.0f;
      for (int64_t j = 0; j < K; j++) acc += weights[j] * to_f32(ys[j * H + n]);
      out[n] = to_bf16(acc);
    }
  });
}

// A lossy routing trim (EngineConfig.top_k_reduction / expert_threshold); {0, 0, false} routes as
// the model does. The rule and its bits are engine/arch/router.py RoutingTrim.apply's.
struct RoutingTrim {
  int64_t reduction = 0;
  double threshold = 0.0;
  bool renormalize = false;
  bool off() const { return reduction == 0 && threshold == 0.0; }
};

// One check for every op that takes a trim: it must leave an expert and be a share.
inline void check_trim(const RoutingTrim& trim, int64_t k, const char* op) {
  TORCH_CHECK(trim.reduction >= 0 && trim.reduction < k && trim.threshold >= 0.0 && trim.threshold <= 1.0, op,
              ": the trim must keep an expert (reduction in 0..k-1) and its threshold be in [0, 1]");
}

// The trim on select_topk's k experts (ids, weights heaviest first, ties by the lower id), in place:
// returns how many are kept, ids[0..kept) and weights[0..kept) heaviest first. The same bits as
// RoutingTrim.apply on the weights the unfused path hands it (route_topk_bf16's, rounded to bf16):
// its stable descending sort keeps select_topk's order (bf16 rounding is monotone: it can tie two
// weights, never swap them), so the K - reduction heaviest are the first ones; the totals are
// fp32 sums left to right as apply sums them; the threshold compares against
// float(threshold) * total (a Python float times an fp32 tensor: the scalar cast to fp32 first);
// renormalising multiplies by total / max(kept total, 1e-20), in fp32. Off: nothing changes.
inline int64_t trim_experts(const RoutingTrim& trim, int64_t k, int64_t* ids, float* weights) {
  if (trim.off()) return k;
  float total = 0.0f;
  for (int64_t j = 0; j < k; j++) {
    weights[j] = round_bf16(weights[j]);  // the weights as the unfused path has them (bf16)
    total = j ? total + weights[j] : weights[j];
  }
  const int64_t width = k - trim.reduction;
  if (trim.threshold > 0.0) {
    const float limit = (float)trim.threshold * total;
    for (int64_t j = 1; j < width; j++)  // the heaviest always stays
      if (weights[j] < limit) weights[j] = 0.0f, ids[j] = -1;  // skipped (apply: weight 0, id -1)
  }
  if (trim.renormalize) {
    float kept_total = weights[0];
    for (int64_t j = 1; j < width; j++) kept_total = kept_total + weights[j];
    const float scale = total / std::max(kept_total, (float)1e-20);
    for (int64_t j = 0; j < width; j++) weights[j] = weights[j] * scale;
  }
  int64_t kept = 0;
  for (int64_t j = 0; j < width; j++) {
    if (ids[j] < 0) continue;  // one token: apply drops the skipped slots
    ids[kept] = ids[j], weights[kept] = weights[j], kept++;
  }
  return kept;
}

// The chosen experts in ascending id order, each with its weight rounded to bf16: the order and the
// weights the unfused path sums in (moe.routed_decode sorts the ids; its weights are bf16). Every
// fused layer takes its experts from here, so fused and unfused give the same bits.
inline void ascending_experts(const int64_t* ids, const float* weights, int64_t k,
                              std::vector<std::pair<int64_t, float>>& chosen) {
  chosen.resize(k);
  for (int64_t j = 0; j < k; j++) chosen[j] = {ids[j], round_bf16(weights[j])};
  std::sort(chosen.begin(), chosen.end());
}

}  // namespace colibri_native
