// The attention half of a decoder layer for one decode token (T == 1) in one call, bf16:
//   x + o_proj(attention(rope(norm_heads(qkv_proj(rms_norm(x))))))   with the K/V cache written.
//
// Why: the same half was ~40 top-level torch operators per token and layer (norm, projection,
// split, views, per-head norms, rope's slices and products, the cache writes, a single-query SDPA,
// the output projection, the residual add), each with its dispatch and Python cost.
//
// Roundings follow the unfused torch path: every projection output, the per-head norms, rope's
// two products and their sum each round to bf16 (as the bf16 tensor ops do); the scores, softmax
// and the weighted sum of values run in fp32 (as SDPA does inside) and round once. The order of
// the fp32 sums differs from torch's SDPA, so outputs agree within bf16 rounding, not bit for bit;
// the op is deterministic (one thread per head and per output row, fixed order), and every
// placement of a model runs it the same way.
//
// Op (namespace colibri):
//   attention_decode_bf16(x [1,H], norm_w [H], eps, qkv_w [(Nq+2Nkv)D, H], q_norm [D] | [0],
//       k_norm [D] | [0], cos [D], sin [D], k_cache [Nkv,ctx,D], v_cache, pos, heads, kv_heads,
//       o_w [H, Nq D]) -> [1, H]
//   q_norm/k_norm empty: no per-head norm. Writes k_cache/v_cache[:, pos]; attends positions 0..pos.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_kernels.h"

namespace {

using namespace colibri_native;

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

struct Scratch {  // per calling thread, reused across calls: no allocation per token but the output
  std::vector<bf16> normed, qkv, attn;
  std::vector<float> tmp;
};

at::Tensor attention_decode_bf16(const at::Tensor& x_in, const at::Tensor& norm_w, double eps, const at::Tensor& qkv_w,
                                 const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t pos,
                                 int64_t heads, int64_t kv_heads, const at::Tensor& o_w) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "attention_decode_bf16: x must be [1, H]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads,
              "attention_decode_bf16: caches must be [Nkv, ctx, D]");
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, "attention_decode_bf16: heads % kv_heads");
  const int64_t H = x.size(1), D = k_cache.size(2), ctx = k_cache.size(1), Q = heads * D, KV = kv_heads * D;
  TORCH_CHECK(pos >= 0 && pos < ctx, "attention_decode_bf16: pos outside the cache");
  TORCH_CHECK(D % 2 == 0 && cos.numel() == D && sin.numel() == D, "attention_decode_bf16: cos/sin must be [D]");
  TORCH_CHECK(norm_w.numel() == H, "attention_decode_bf16: norm_w must be [H]");
  TORCH_CHECK(qkv_w.dim() == 2 && qkv_w.size(0) == Q + 2 * KV && qkv_w.size(1) == H,
              "attention_decode_bf16: qkv_w must be [(Nq + 2 Nkv) D, H]");
  TORCH_CHECK(o_w.dim() == 2 && o_w.size(0) == H && o_w.size(1) == Q, "attention_decode_bf16: o_w must be [H, Nq D]");
  TORCH_CHECK((q_norm.numel() == 0 || q_norm.numel() == D) && q_norm.numel() == k_norm.numel(),
              "attention_decode_bf16: q_norm/k_norm must both be [D] or both empty");
  const bf16* xp = bf16_data(x, "x");
  const bf16* wq = bf16_data(qkv_w, "qkv_w");
  const bf16* wo = bf16_data(o_w, "o_w");
  bf16* kc = const_cast<bf16*>(bf16_data(k_cache, "k_cache"));
  bf16* vc = const_cast<bf16*>(bf16_data(v_cache, "v_cache"));
  static thread_local Scratch scratch;
  Scratch& s = scratch;  // the caller's: the region's threads share it (a thread_local named there is theirs)
  s.normed.resize(H), s.qkv.resize(Q + 2 * KV), s.attn.resize(Q), s.tmp.resize(D);
  {  // the input norm: as layers.rms_norm of one token
    float ss = 0.0f;
    for (int64_t i = 0; i < H; i++) ss += to_f32(xp[i]) * to_f32(xp[i]);
    const float inv = 1.0f / std::sqrt(ss / (float)H + (float)eps);
    const bf16* nw = bf16_data(norm_w, "norm_w");
    for (int64_t i = 0; i < H; i++) s.normed[i] = to_bf16(to_f32(nw[i]) * round_bf16(to_f32(xp[i]) * inv));
  }
  bf16* qkv = s.qkv.data();
  const bf16* normed = s.normed.data();
  bf16 *q = qkv, *k = qkv + Q, *v = qkv + Q + KV;
  float* tmp = s.tmp.data();
  const bf16* qn = q_norm.numel() ? bf16_data(q_norm, "q_norm") : nullptr;
  const bf16* kn = q_norm.numel() ? bf16_data(k_norm, "k_norm") : nullptr;
  const bf16* cp = bf16_data(cos, "cos");
  const bf16* sp = bf16_data(sin, "sin");
  const int64_t S = pos + 1, group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt((float)D);
  bf16* attn = s.attn.data();
  at::Tensor y = at::empty({1, H}, x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  // One parallel region (q/k/v rows | per-head norms, rope, cache write | heads | o_proj rows),
  // split statically: barriers where separate parallel loops paid a fork and join each.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    thread_share(Q + 2 * KV, 4, t, T, b, e);
    dot_rows(wq, H, normed, b, e, [&](int64_t n, float val) { qkv[n] = to_bf16(val); });
#pragma omp barrier
#pragma omp single
    {  // a few hundred elements: one thread (the single's implicit barrier publishes them)
      if (qn) {
        norm_heads(q, heads, D, qn, (float)eps);
        norm_heads(k, kv_heads, D, kn, (float)eps);
      }
      rope_heads(q, heads, D, cp, sp, tmp);
      rope_heads(k, kv_heads, D, cp, sp, tmp);
      for (int64_t g = 0; g < kv_heads; g++) {  // the cache rows of this position
        std::copy(k + g * D, k + (g + 1) * D, kc + (g * ctx + pos) * D);
        std::copy(v + g * D, v + (g + 1) * D, vc + (g * ctx + pos) * D);
      }
    }
    thread_share(heads, 1, t, T, b, e);
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
    thread_share(H, 4, t, T, b, e);  // o_proj, then the residual add
    dot_rows(wo, Q, attn, b, e, [&](int64_t n, float val) { yp[n] = to_bf16(to_f32(xp[n]) + round_bf16(val)); });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("attention_decode_bf16(Tensor x, Tensor norm_w, float eps, Tensor qkv_w, Tensor q_norm, Tensor k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int pos, int heads, int kv_heads, "
        "Tensor o_w) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("attention_decode_bf16", &attention_decode_bf16);
}
