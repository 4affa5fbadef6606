// The attention half of a decoder layer for one decode token, bf16, as inline functions: the one
// op of attention_decode.cpp and the whole-step loop of decode_step.cpp both run attention_rows, so
// a layer gives the same bits either way. (Roundings and order: attention_decode.cpp's header.)
#pragma once

#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_kernels.h"

namespace colibri_native {

// Per-head RMSNorm of n rows of D, in place (as layers.rms_norm: round(w * round(x * r))).
inline void norm_heads(bf16* rows, int64_t n, int64_t D, const bf16* w, float eps) {
  for (int64_t r = 0; r < n; r++) {
    bf16* x = rows + r * D;
    float ss = 0.0f;
    for (int64_t i = 0; i < D; i++) ss += to_f32(x[i]) * to_f32(x[i]);
    const float inv = 1.0f / std::sqrt(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) x[i] = to_bf16(to_f32(w[i]) * round_bf16(to_f32(x[i]) * inv));
  }
}

// Rotate-half rope of n rows of D in place: x * cos + cat(-x2, x1) * sin, each product rounded.
inline void rope_heads(bf16* rows, int64_t n, int64_t D, const bf16* cos, const bf16* sin, float* tmp) {
  const int64_t half = D / 2;
  for (int64_t r = 0; r < n; r++) {
    bf16* x = rows + r * D;
    for (int64_t i = 0; i < D; i++) {
      const float rotated = i < half ? -to_f32(x[i + half]) : to_f32(x[i - half]);
      tmp[i] = round_bf16(round_bf16(to_f32(x[i]) * to_f32(cos[i])) + round_bf16(rotated * to_f32(sin[i])));
    }
    for (int64_t i = 0; i < D; i++) x[i] = to_bf16(tmp[i]);
  }
}

// One layer's attention operands as raw rows (checked once by attention_layer).
struct AttnLayer {
  const bf16 *norm_w, *qkv_w, *q_norm, *k_norm, *o_w;  // q_norm / k_norm null: no per-head norm
  bf16 *k_cache, *v_cache;                             // [Nkv, ctx, D]
  int64_t H, D, ctx, heads, kv_heads;
};

inline AttnLayer attention_layer(int64_t H, const at::Tensor& norm_w, const at::Tensor& qkv_w, const at::Tensor& q_norm,
                                 const at::Tensor& k_norm, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 int64_t heads, int64_t kv_heads, const at::Tensor& o_w) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads,
              "attention_decode_bf16: caches must be [Nkv, ctx, D]");
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, "attention_decode_bf16: heads % kv_heads");
  const int64_t D = k_cache.size(2), Q = heads * D, KV = kv_heads * D;
  TORCH_CHECK(D % 2 == 0, "attention_decode_bf16: head_dim must be even");
  TORCH_CHECK(norm_w.numel() == H, "attention_decode_bf16: norm_w must be [H]");
  TORCH_CHECK(qkv_w.dim() == 2 && qkv_w.size(0) == Q + 2 * KV && qkv_w.size(1) == H,
              "attention_decode_bf16: qkv_w must be [(Nq + 2 Nkv) D, H]");
  TORCH_CHECK(o_w.dim() == 2 && o_w.size(0) == H && o_w.size(1) == Q, "attention_decode_bf16: o_w must be [H, Nq D]");
  TORCH_CHECK((q_norm.numel() == 0 || q_norm.numel() == D) && q_norm.numel() == k_norm.numel(),
              "attention_decode_bf16: q_norm/k_norm must both be [D] or both empty");
  AttnLayer L;
  L.norm_w = bf16_data(norm_w, "norm_w");
  L.qkv_w = bf16_data(qkv_w, "qkv_w");
  L.o_w = bf16_data(o_w, "o_w");
  L.q_norm = q_norm.numel() ? bf16_data(q_norm, "q_norm") : nullptr;
  L.k_norm = q_norm.numel() ? bf16_data(k_norm, "k_norm") : nullptr;
  L.k_cache = const_cast<bf16*>(bf16_data(k_cache, "k_cache"));
  L.v_cache = const_cast<bf16*>(bf16_data(v_cache, "v_cache"));
  L.H = H, L.D = D, L.ctx = k_cache.size(1), L.heads = heads, L.kv_heads = kv_heads;
  return L;
}

struct AttnScratch {  // per calling thread, reused across calls: no allocation per token
  std::vector<bf16> normed, qkv, attn;
  std::vector<float> tmp;
};

// y = x + o_proj(attention(rope(norm_heads(qkv_proj(rms_norm(x)))))) for one token at `pos`
// (0 <= pos < ctx), writing the caches' rows at pos. x and y [H] may not alias.
inline void attention_rows(const AttnLayer& L, const bf16* xp, const bf16* cp, const bf16* sp, int64_t pos,
                           float eps, AttnScratch& s, bf16* yp) {
  const int64_t H = L.H, D = L.D, ctx = L.ctx, heads = L.heads, kv_heads = L.kv_heads;
  const int64_t Q = heads * D, KV = kv_heads * D;
  const bf16 *wq = L.qkv_w, *wo = L.o_w, *qn = L.q_norm, *kn = L.k_norm;
  bf16 *kc = L.k_cache, *vc = L.v_cache;
  s.normed.resize(H), s.qkv.resize(Q + 2 * KV), s.attn.resize(Q), s.tmp.resize(D);
  {  // the input norm: as layers.rms_norm of one token
    float ss = 0.0f;
    for (int64_t i = 0; i < H; i++) ss += to_f32(xp[i]) * to_f32(xp[i]);
    const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
    const bf16* nw = L.norm_w;
    for (int64_t i = 0; i < H; i++) s.normed[i] = to_bf16(to_f32(nw[i]) * round_bf16(to_f32(xp[i]) * inv));
  }
  bf16* qkv = s.qkv.data();
  const bf16* normed = s.normed.data();
  bf16 *q = qkv, *k = qkv + Q, *v = qkv + Q + KV;
  float* tmp = s.tmp.data();
  const int64_t S = pos + 1, group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt((float)D);
  bf16* attn = s.attn.data();
  // One parallel region (q/k/v rows | per-head norms, rope, cache write | heads | o_proj rows),
  // split statically: barriers where separate parallel loops paid a fork and join each.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    thread_share(Q + 2 * KV, t, T, b, e);
    dot_rows(wq, H, normed, b, e, [&](int64_t n, float val) { qkv[n] = to_bf16(val); });
#pragma omp barrier
#pragma omp single
    {  // a few hundred elements: one thread (the single's implicit barrier publishes them)
      if (qn) {
        norm_heads(q, heads, D, qn, eps);
        norm_heads(k, kv_heads, D, kn, eps);
      }
      rope_heads(q, heads, D, cp, sp, tmp);
      rope_heads(k, kv_heads, D, cp, sp, tmp);
      for (int64_t g = 0; g < kv_heads; g++) {  // the cache rows of this position
        std::copy(k + g * D, k + (g + 1) * D, kc + (g * ctx + pos) * D);
        std::copy(v + g * D, v + (g + 1) * D, vc + (g * ctx + pos) * D);
      }
    }
    thread_share(heads, t, T, b, e);
    if (b < e) {
      static thread_local std::vector<float> p, acc;  // per worker thread, reused across calls
      p.resize(S), acc.resize(D);
      for (int64_t hd = b; hd < e; hd++) {
        const bf16* keys = kc + (hd / group) * ctx * D;
        const bf16* values = vc + (hd / group) * ctx * D;
        float m = -INFINITY;
        dot_rows(keys, D, q + hd * D, 0, S, [&](int64_t j, float val) {
          p[j] = val * scale;
          m = std::max(m, p[j]);
        });
        float sum = 0.0f;
        for (int64_t j = 0; j < S; j++) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < S; j++) {
          const bf16* vr = values + j * D;
          for (int64_t i = 0; i < D; i++) acc[i] += p[j] * to_f32(vr[i]);
        }
        for (int64_t i = 0; i < D; i++) attn[hd * D + i] = to_bf16(acc[i] / sum);
      }
    }
#pragma omp barrier
    thread_share(H, t, T, b, e);  // o_proj, then the residual add
    dot_rows(wo, Q, attn, b, e, [&](int64_t n, float val) { yp[n] = to_bf16(to_f32(xp[n]) + round_bf16(val)); });
  }
}

}  // namespace colibri_native
