// The attention half of a decoder layer for one decode token, bf16, as inline functions: the one
// op of attention_decode.cpp and the whole-step loop of decode_step.cpp both run attention_rows, so
// a layer gives the same bits either way. (Roundings and order: attention_decode.cpp's header.)
// attention_rows is a template on the projections' kind: Bf16Proj here (bf16 rows), QuantProj in
// attention_int.h (int8 / int4); everything between the projections is the same code for both.
// The K/V cache is either bf16 rows or codes (int8 / e4m3) with one fp32 scale per row (KvRows).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "attention_math.h"
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

// Rotate-half rope of n rows of D in place over their first `rot` dims (rot == D: the whole head;
// less: partial rotary, glm4_moe's, the rest passing through as rope.apply_rope leaves it):
// x * cos + cat(-x2, x1) * sin, each product rounded; cos/sin [rot].
inline void rope_heads(bf16* rows, int64_t n, int64_t D, int64_t rot, const bf16* cos, const bf16* sin, float* tmp) {
  const int64_t half = rot / 2;
  for (int64_t r = 0; r < n; r++) {
    bf16* x = rows + r * D;
    for (int64_t i = 0; i < rot; i++) {
      const float rotated = i < half ? -to_f32(x[i + half]) : to_f32(x[i - half]);
      tmp[i] = round_bf16(round_bf16(to_f32(x[i]) * to_f32(cos[i])) + round_bf16(rotated * to_f32(sin[i])));
    }
    for (int64_t i = 0; i < rot; i++) x[i] = to_bf16(tmp[i]);
  }
}

// One layer's K or V cache [Nkv, ctx, D]: bf16 rows, or codes with one fp32 scale per row (per
// token per head), as engine/arch/kvquant.py's QuantizedRows holds them. Writes quantize as its
// __setitem__ does. Reads give the codes themselves as bf16 (exact: an int8 code has 7 significant
// bits, an e4m3 value 4, bf16 holds 8, and the smallest e4m3 value 2^-9 is no fp32 denormal) and
// the row's scale is applied once per row: to the score (q . code) * scale and to the softmax
// weight p * scale before the weighted sum. Why: rounding code * scale to bf16 per element (as
// QuantizedRows.__getitem__ does) cost a multiply and ~8 integer steps per 16 numbers, which made a
// resident int8 / fp8 cache slower than bf16 at demo's sizes though it moves half the bytes; per
// row it is one multiply. The sums differ from the unfused path's only in that bf16 rounding
// (skipped here, so these are the closer to the exact code * scale), as a bf16 cache's sums differ
// from SDPA's in their order.
enum class KvCode { bf16, int8, e4m3 };

struct KvRows {
  void* data = nullptr;     // [Nkv, ctx, D]: bf16, int8 or e4m3 bytes
  float* scales = nullptr;  // [Nkv, ctx]: codes only
  KvCode code = KvCode::bf16;
  int64_t ctx = 0, D = 0;

  // Row (g, pos) <- src [D] (bf16). Codes: scale = max(amax |x|, 1e-30) / qmax, code = x / scale,
  // int8 rounded half to even and clamped to +-127, e4m3 clamped to +-448 then cast (torch's
  // c10 conversion: round to nearest even). fp32 throughout, as QuantizedRows.__setitem__.
  inline void write(int64_t g, int64_t pos, const bf16* src) const {
    const int64_t row = g * ctx + pos;
    if (code == KvCode::bf16) {
      std::copy(src, src + D, reinterpret_cast<bf16*>(data) + row * D);
      return;
    }
    const float qmax = code == KvCode::int8 ? 127.0f : 448.0f;
    float amax = 0.0f;
    for (int64_t i = 0; i < D; i++) {  // a NaN propagates, as torch's amax
      const float a = std::fabs(to_f32(src[i]));
      amax = (a > amax || std::isnan(a)) && !std::isnan(amax) ? a : amax;
    }
    const float scale = (std::isnan(amax) ? amax : std::max(amax, 1e-30f)) / qmax;
    scales[row] = scale;
    if (code == KvCode::int8) {
      int8_t* out = reinterpret_cast<int8_t*>(data) + row * D;
      for (int64_t i = 0; i < D; i++)  // (a NaN code: torch's float -> int8 cast is undefined there too)
        out[i] = (int8_t)std::min(std::max(std::nearbyint(to_f32(src[i]) / scale), -qmax), qmax);
    } else {
      uint8_t* out = reinterpret_cast<uint8_t*>(data) + row * D;
      for (int64_t i = 0; i < D; i++) {
        const float x = to_f32(src[i]) / scale;
        out[i] = c10::Float8_e4m3fn(std::isnan(x) ? x : std::min(std::max(x, -qmax), qmax)).x;
      }
    }
  }

  // Rows j0 .. j0+n of head g as bf16: the cache's own rows, or (codes) the codes converted exactly
  // into buf [n, D], their scales (row_scales) still to apply.
  inline const bf16* rows(int64_t g, int64_t j0, int64_t n, bf16* buf) const {
    const int64_t row0 = g * ctx + j0;
    if (code == KvCode::bf16) return reinterpret_cast<const bf16*>(data) + row0 * D;
    for (int64_t j = 0; j < n; j++) {
      const uint8_t* c = reinterpret_cast<const uint8_t*>(data) + (row0 + j) * D;
      bf16* out = buf + j * D;
      for (int64_t i = 0; i < D; i += 16) {
        const __mmask16 m = D - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - i)) - 1);
        const __m128i bytes = _mm_maskz_loadu_epi8(m, c + i);
        const __m512 f = code == KvCode::int8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) : e4m3_to_f32(bytes);
        _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(f));  // exact (see above)
      }
    }
    return buf;
  }

  // The scales of rows j0 .. j0+n of head g (codes only; a bf16 cache has none: nullptr).
  inline const float* row_scales(int64_t g, int64_t j0) const {
    return code == KvCode::bf16 ? nullptr : scales + g * ctx + j0;
  }
};

// A cache tensor [Nkv, ctx, D] and its scales ([Nkv, ctx] fp32 for int8 / e4m3 codes, empty for bf16).
inline KvRows kv_rows(const at::Tensor& cache, const at::Tensor& scales, const char* what) {
  TORCH_CHECK(cache.dim() == 3 && cache.device().is_cpu() && cache.is_contiguous(), what,
              " must be a contiguous CPU [Nkv, ctx, D] tensor");
  KvRows r;
  r.data = cache.data_ptr();
  r.ctx = cache.size(1), r.D = cache.size(2);
  const auto type = cache.scalar_type();
  if (type == at::kBFloat16) {
    TORCH_CHECK(scales.numel() == 0, what, ": a bf16 cache has no scales");
    return r;
  }
  TORCH_CHECK(type == at::kChar || type == at::kFloat8_e4m3fn, what, " must be bfloat16, int8 or float8_e4m3fn");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.device().is_cpu() && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == cache.size(0) && scales.size(1) == r.ctx,
              what, " scales must be a contiguous fp32 [Nkv, ctx] tensor");
  r.code = type == at::kChar ? KvCode::int8 : KvCode::e4m3;
  r.scales = scales.data_ptr<float>();
  return r;
}

// The bf16 projections: q/k/v as one fused [(Nq + 2 Nkv) D, H] matrix and o_proj [H, Nq D], bf16 rows
// (the other kind, int8 / int4 QMats, is attention_int.h's QuantProj). attention_batch calls
// prepare_in once before its parallel region, qkv_rows / o_rows from every thread (each emits
// emit(row, n, fp32 dot) for its weight rows and every activation row), and prepare_out in a single
// between the heads and o_proj where prepares_out says so (bf16: no extra barrier, the loop as
// before the template). One activation row: dot_rows, the one-token stream; several (a batched
// step): each weight row read once and dotted with all of them (dot_rows_many), every output dot()'s bits.
struct Bf16Proj {
  const bf16 *qkv_w = nullptr, *o_w = nullptr;
  struct Scratch {};
  static constexpr bool prepares_out = false;
  void prepare_in(const bf16* const*, int64_t, int64_t, Scratch&) const {}
  void prepare_out(const bf16* const*, int64_t, int64_t, Scratch&) const {}
  template <class Emit>
  static void share(const bf16* w, const bf16* const* x, int64_t B, int64_t K, int64_t N, int t, int T, Emit emit) {
    int64_t b, e;
    thread_share(N, t, T, b, e);
    if (B == 1) return dot_rows(w, K, x[0], b, e, [&](int64_t n, float v) { emit(0, n, v); });
    dot_rows_many(w, N, K, x, B, b, e, emit);
  }
  template <class Emit>
  void qkv_rows(const bf16* const* x, int64_t B, int64_t H, int64_t N, int t, int T, Scratch&, Emit emit) const {
    share(qkv_w, x, B, H, N, t, T, emit);
  }
  template <class Emit>
  void o_rows(const bf16* const* a, int64_t B, int64_t Q, int64_t H, int t, int T, Scratch&, Emit emit) const {
    share(o_w, a, B, Q, H, t, T, emit);
  }
};

// One layer's attention operands as raw rows (checked once by attention_layer / attention_common).
template <class Proj>
struct AttnLayer {
  const bf16 *norm_w, *q_norm, *k_norm;  // q_norm / k_norm null: no per-head norm
  Proj proj;
  KvRows k_cache, v_cache;  // [Nkv, ctx, D]
  int64_t H, D, ctx, heads, kv_heads;
  int64_t rot = 0;              // rotary dims of each head (D, or fewer: partial rotary); cos/sin rows are [rot]
  const bf16* qkv_b = nullptr;  // the q/k/v projections' biases [(Nq + 2 Nkv) D], or none (bf16 only)
};

// Everything of a layer but its projections (the caller checks and sets L.proj), `what` naming the op.
template <class Proj>
inline void attention_common(int64_t H, const at::Tensor& norm_w, const at::Tensor& q_norm, const at::Tensor& k_norm,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scales,
                             const at::Tensor& v_scales, int64_t heads, int64_t kv_heads, const std::string& what,
                             AttnLayer<Proj>& L) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == kv_heads &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              what, ": caches must be [Nkv, ctx, D], both of one dtype");
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, what, ": heads % kv_heads");
  const int64_t D = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0, what, ": head_dim must be even");
  TORCH_CHECK(norm_w.numel() == H, what, ": norm_w must be [H]");
  TORCH_CHECK((q_norm.numel() == 0 || q_norm.numel() == D) && q_norm.numel() == k_norm.numel(),
              what, ": q_norm/k_norm must both be [D] or both empty");
  L.norm_w = bf16_data(norm_w, "norm_w");
  L.q_norm = q_norm.numel() ? bf16_data(q_norm, "q_norm") : nullptr;
  L.k_norm = q_norm.numel() ? bf16_data(k_norm, "k_norm") : nullptr;
  L.k_cache = kv_rows(k_cache, k_scales, (what + ": k_cache").c_str());
  L.v_cache = kv_rows(v_cache, v_scales, (what + ": v_cache").c_str());
  L.H = H, L.D = D, L.ctx = k_cache.size(1), L.heads = heads, L.kv_heads = kv_heads;
  L.rot = D;
}

inline AttnLayer<Bf16Proj> attention_layer(int64_t H, const at::Tensor& norm_w, const at::Tensor& qkv_w,
                                           const at::Tensor& q_norm, const at::Tensor& k_norm,
                                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& k_scales, const at::Tensor& v_scales, int64_t heads,
                                           int64_t kv_heads, const at::Tensor& o_w,
                                           const c10::optional<at::Tensor>& qkv_b = c10::nullopt, int64_t rot = 0) {
  AttnLayer<Bf16Proj> L;
  attention_common(H, norm_w, q_norm, k_norm, k_cache, v_cache, k_scales, v_scales, heads, kv_heads,
                   "attention_decode_bf16", L);
  const int64_t Q = heads * L.D, KV = kv_heads * L.D;
  TORCH_CHECK(qkv_w.dim() == 2 && qkv_w.size(0) == Q + 2 * KV && qkv_w.size(1) == H,
              "attention_decode_bf16: qkv_w must be [(Nq + 2 Nkv) D, H]");
  TORCH_CHECK(o_w.dim() == 2 && o_w.size(0) == H && o_w.size(1) == Q, "attention_decode_bf16: o_w must be [H, Nq D]");
  L.proj.qkv_w = bf16_data(qkv_w, "qkv_w");
  L.proj.o_w = bf16_data(o_w, "o_w");
  if (rot) {
    TORCH_CHECK(rot > 0 && rot <= L.D && rot % 2 == 0, "attention_decode_bf16: rot must be even, in 1..head_dim");
    L.rot = rot;
  }
  if (qkv_b.has_value() && qkv_b->defined()) {  // added to the fp32 dot before its one rounding, as addmm does
    TORCH_CHECK(qkv_b->dim() == 1 && qkv_b->size(0) == Q + 2 * KV && qkv_b->is_contiguous(),
                "attention_decode_bf16: qkv_b must be a contiguous [(Nq + 2 Nkv) D]");
    L.qkv_b = bf16_data(*qkv_b, "qkv_b");
  }
  return L;
}

// Cache rows per block of the heads loop: 64 rows of D = 128 are 16 KiB of bf16, L1-sized.
constexpr int64_t KV_BLOCK = 64;

template <class Proj>
struct AttnScratch {  // per calling thread, reused across calls: no allocation per token
  std::vector<bf16> normed, qkv, attn;
  std::vector<float> tmp;
  std::vector<const bf16*> normed_rows, attn_rows;
  typename Proj::Scratch proj;
};

// One row of attention_batch: its input x [H], rope row cos/sin [D], position, the K/V cache it
// writes (at pos) and attends (0..pos), and its output y [H] (not aliasing x).
struct AttnRow {
  const bf16 *x, *cos, *sin;
  int64_t pos;
  KvRows k_cache, v_cache;
  bf16* y;
};

// y = x + o_proj(attention(rope(norm_heads(qkv_proj(rms_norm(x)))))) for B rows, each one token at
// its own position of its own cache (B sequences in one step), or consecutive positions of one cache
// (a verify): the layer's weights read once for all rows (the projections' qkv_rows / o_rows), every
// row's values computed as for that row alone, so each row is bit for bit the one-row call (B = 1,
// attention_rows). Phases: the q/k/v rows of every row | per row, in row order, its per-head norms,
// rope and cache write | every row's heads | o_proj rows. All writes land before any head reads, and a
// row attends only positions <= its own: rows sharing a cache give the one-at-a-time bits where their
// positions increase with the row (the caller checks).
template <class Proj>
inline void attention_batch(const AttnLayer<Proj>& L, const AttnRow* R, int64_t B, float eps, AttnScratch<Proj>& s) {
  const int64_t H = L.H, D = L.D, heads = L.heads, kv_heads = L.kv_heads;
  const int64_t Q = heads * D, KV = kv_heads * D, W = Q + 2 * KV;
  const bf16 *qn = L.q_norm, *kn = L.k_norm;
  const Proj& proj = L.proj;
  s.normed.resize(B * H), s.qkv.resize(B * W), s.attn.resize(B * Q), s.tmp.resize(D);
  s.normed_rows.resize(B), s.attn_rows.resize(B);
  for (int64_t r = 0; r < B; r++) {  // the input norm: as layers.rms_norm of one token
    const bf16* xp = R[r].x;
    bf16* normed = s.normed.data() + r * H;
    float ss = 0.0f;
    for (int64_t i = 0; i < H; i++) ss += to_f32(xp[i]) * to_f32(xp[i]);
    const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
    const bf16* nw = L.norm_w;
    for (int64_t i = 0; i < H; i++) normed[i] = to_bf16(to_f32(nw[i]) * round_bf16(to_f32(xp[i]) * inv));
    s.normed_rows[r] = normed;
    s.attn_rows[r] = s.attn.data() + r * Q;
  }
  bf16* qkv = s.qkv.data();
  proj.prepare_in(s.normed_rows.data(), B, H, s.proj);  // (int: each row quantized once, as the int linear op does)
  float* tmp = s.tmp.data();
  const int64_t group = heads / kv_heads;
  const float scale = 1.0f / std::sqrt((float)D);
  bf16* attn = s.attn.data();
  // One parallel region (q/k/v rows | per-head norms, rope, cache write | heads | o_proj rows),
  // split statically: barriers where separate parallel loops paid a fork and join each.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t b, e;
    const bf16* qkv_b = L.qkv_b;
    proj.qkv_rows(s.normed_rows.data(), B, H, W, t, T, s.proj, [&](int64_t r, int64_t n, float val) {
      qkv[r * W + n] = to_bf16(qkv_b ? val + to_f32(qkv_b[n]) : val);
    });
#pragma omp barrier
#pragma omp single
    {  // a few hundred elements a row: one thread (the single's implicit barrier publishes them)
      for (int64_t r = 0; r < B; r++) {
        bf16 *q = qkv + r * W, *k = q + Q, *v = q + Q + KV;
        if (qn) {
          norm_heads(q, heads, D, qn, eps);
          norm_heads(k, kv_heads, D, kn, eps);
        }
        rope_heads(q, heads, D, L.rot, R[r].cos, R[r].sin, tmp);
        rope_heads(k, kv_heads, D, L.rot, R[r].cos, R[r].sin, tmp);
        for (int64_t g = 0; g < kv_heads; g++) {  // the cache rows of this position (quantized: their codes)
          R[r].k_cache.write(g, R[r].pos, k + g * D);
          R[r].v_cache.write(g, R[r].pos, v + g * D);
        }
      }
    }
    thread_share(B * heads, t, T, b, e);
    // This thread's (row, head) items, a run of one row's K/V head group at a time: each block of
    // cache rows is read (quantized: its codes converted) once for the run, not once per query head.
    // Per head the sums run in the same order as one head alone (positions ascending), whatever the runs.
    static thread_local std::vector<float> p, acc, m, sum;  // per worker thread, reused across calls
    static thread_local std::vector<bf16> block;            // codes as bf16 (quantized caches)
    for (int64_t i0 = b; i0 < e;) {
      const int64_t r = i0 / heads, h0 = i0 % heads, g = h0 / group;
      const int64_t h1 = std::min(e - r * heads, (g + 1) * group), n = h1 - h0;
      const KvRows &kc = R[r].k_cache, &vc = R[r].v_cache;
      const int64_t S = R[r].pos + 1;
      const bf16* q = qkv + r * W;
      p.resize(n * S), acc.resize(n * D), m.assign(n, -INFINITY), sum.assign(n, 0.0f);
      if (kc.code != KvCode::bf16) block.resize(KV_BLOCK * D);
      for (int64_t j0 = 0; j0 < S; j0 += KV_BLOCK) {
        const int64_t rows = std::min(KV_BLOCK, S - j0);
        const bf16* keys = kc.rows(g, j0, rows, block.data());
        const float* ks = kc.row_scales(g, j0);
        for (int64_t h = 0; h < n; h++) {
          float* ph = p.data() + h * S + j0;
          qk_scores(keys, rows, D, q + (h0 + h) * D, ph);
          for (int64_t j = 0; j < rows; j++) {
            ph[j] = ks ? ph[j] * ks[j] * scale : ph[j] * scale;
            m[h] = std::max(m[h], ph[j]);
          }
        }
      }
      for (int64_t h = 0; h < n; h++) {
        float* ph = p.data() + h * S;
        exp_minus_max(ph, S, m[h]);
        for (int64_t j = 0; j < S; j++) sum[h] += ph[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0; j0 < S; j0 += KV_BLOCK) {
        const int64_t rows = std::min(KV_BLOCK, S - j0);
        const bf16* values = vc.rows(g, j0, rows, block.data());
        const float* vs = vc.row_scales(g, j0);
        for (int64_t h = 0; h < n; h++) pv_accumulate(values, rows, D, p.data() + h * S + j0, vs, acc.data() + h * D);
      }
      bf16* ar = attn + r * Q;
      for (int64_t h = 0; h < n; h++)
        for (int64_t i = 0; i < D; i++) ar[(h0 + h) * D + i] = to_bf16(acc[h * D + i] / sum[h]);
      i0 = r * heads + h1;
    }
#pragma omp barrier
    if constexpr (Proj::prepares_out) {
#pragma omp single
      proj.prepare_out(s.attn_rows.data(), B, Q, s.proj);  // (the single's implicit barrier publishes it)
    }
    // o_proj, then the residual add
    proj.o_rows(s.attn_rows.data(), B, Q, H, t, T, s.proj, [&](int64_t r, int64_t n, float val) {
      R[r].y[n] = to_bf16(to_f32(R[r].x[n]) + round_bf16(val));
    });
  }
}

// The rows of a batched op, checked: x [B, H] bf16 (contiguous), cos/sin [B, D] (row r at r * D),
// per row a K and a V cache [Nkv, ctx, D] (each row's own ctx; bf16, or int8 / e4m3 codes with their
// [Nkv, ctx] fp32 scales, as kv_rows takes one) and a position in the cache; y [B, H] out. Rows that
// share a cache must come in increasing positions (attention_batch writes every row's K/V before any
// row attends), and a cache is K for all its rows or V for all.
inline std::vector<AttnRow> attention_row_list(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                               at::TensorList k_caches, at::TensorList v_caches,
                                               at::TensorList k_scales, at::TensorList v_scales,
                                               at::IntArrayRef pos, int64_t kv_heads, int64_t D, at::Tensor& y,
                                               const std::string& what, int64_t rot = 0) {
  const int64_t B = x.size(0), H = x.size(1);
  TORCH_CHECK((int64_t)k_caches.size() == B && (int64_t)v_caches.size() == B && (int64_t)pos.size() == B &&
                  (int64_t)k_scales.size() == B && (int64_t)v_scales.size() == B,
              what, ": one K cache, V cache, K and V scales and position per row of x");
  if (!rot) rot = D;  // cos/sin rows: the rotary dims (partial rotary: fewer than D)
  TORCH_CHECK(cos.numel() == B * rot && sin.numel() == B * rot, what, ": cos/sin must be [B, rotary dims]");
  const bf16 *xp = bf16_data(x, "x"), *cp = bf16_data(cos, "cos"), *sp = bf16_data(sin, "sin");
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  std::vector<AttnRow> rows(B);
  std::vector<std::pair<const void*, int64_t>> last;  // (cache data, (row, position) of its latest row)
  std::vector<std::pair<const void*, bool>> role;     // (cache data, is a K cache)
  for (int64_t r = 0; r < B; r++) {
    const at::Tensor &kc = k_caches[r], &vc = v_caches[r];
    TORCH_CHECK(kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.size(0) == kv_heads && kc.size(2) == D &&
                    kc.scalar_type() == vc.scalar_type(),
                what, ": row ", r, ": caches must be [Nkv, ctx, D] of the layer's Nkv and D, both of one dtype");
    TORCH_CHECK(pos[r] >= 0 && pos[r] < kc.size(1), what, ": row ", r, ": position ", pos[r], " outside its cache");
    for (int c = 0; c < 2; c++) {
      const void* data = (c ? vc : kc).data_ptr();
      for (const auto& [d, is_k] : role)
        TORCH_CHECK(d != data || is_k == (c == 0), what, ": row ", r, ": one tensor is a K cache and a V cache");
      role.push_back({data, c == 0});
      for (auto& [d, p] : last)
        if (d == data) {
          TORCH_CHECK(pos[r] > p, what, ": row ", r, ": rows that share a cache must come in increasing positions");
        }
      last.push_back({data, pos[r]});
    }
    rows[r] = {xp + r * H, cp + r * rot, sp + r * rot, pos[r], kv_rows(kc, k_scales[r], (what + ": k_cache").c_str()),
               kv_rows(vc, v_scales[r], (what + ": v_cache").c_str()), yp + r * H};
  }
  return rows;
}

// y = x + o_proj(attention(rope(norm_heads(qkv_proj(rms_norm(x)))))) for one token at `pos`
// (0 <= pos < ctx), writing the layer's caches' rows at pos: attention_batch of one row. x and y [H]
// may not alias.
template <class Proj>
inline void attention_rows(const AttnLayer<Proj>& L, const bf16* xp, const bf16* cp, const bf16* sp, int64_t pos,
                           float eps, AttnScratch<Proj>& s, bf16* yp) {
  const AttnRow row{xp, cp, sp, pos, L.k_cache, L.v_cache, yp};
  attention_batch(L, &row, 1, eps, s);
}

}  // namespace colibri_native
