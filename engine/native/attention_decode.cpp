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
// A quantized cache (kv_dtype int8 / fp8: codes + one fp32 scale per token per head, as
// engine/arch/kvquant.py's QuantizedRows) is written and read here too: the new row's codes and
// scale are what QuantizedRows.__setitem__ stores; a cached row's codes enter the scores and the
// weighted sum as they are, its scale applied once per row (attention_kernels.h, KvRows), where
// the unfused path rounds code * scale to bf16 first: the paths differ by that rounding and the
// order of the sums.
//
// Op (namespace colibri):
//   attention_decode_bf16(x [1,H], norm_w [H], eps, qkv_w [(Nq+2Nkv)D, H], q_norm [D] | [0],
//       k_norm [D] | [0], cos [D], sin [D], k_cache [Nkv,ctx,D], v_cache, k_scales [Nkv,ctx] | [0],
//       v_scales, pos, heads, kv_heads, o_w [H, Nq D]) -> [1, H]
//   qkv_b [(Nq+2Nkv)D] (optional): the q/k/v biases, added before the projection's one rounding;
//   rot (0: D): the rotary dims of each head (partial rotary: cos/sin [rot], the rest unrotated).
//   q_norm/k_norm empty: no per-head norm. Caches bf16 with empty scales, or int8 / float8_e4m3fn
//   codes with fp32 scales. Writes k_cache/v_cache[:, pos] (and the scales'); attends positions 0..pos.
//   attention_decode_rows_bf16(x [B,H], norm_w, eps, qkv_w, q_norm, k_norm, cos [B,D], sin [B,D],
//       k_caches [B], v_caches [B], k_scales [B], v_scales [B], pos int[B], heads, kv_heads, o_w) -> [B, H]
//   B rows of a batched decode step, each with its own caches (as above) and position: the layer's
//   weights read once for all rows (attention_kernels.h attention_batch), row r bit for bit
//   attention_decode_bf16 on row r alone. Rows sharing a cache (a verify's consecutive positions)
//   must come in increasing positions; their K/V are all written before any row attends.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "attention_kernels.h"

namespace {

using namespace colibri_native;

at::Tensor attention_decode_bf16(const at::Tensor& x_in, const at::Tensor& norm_w, double eps, const at::Tensor& qkv_w,
                                 const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& k_scales, const at::Tensor& v_scales, int64_t pos,
                                 int64_t heads, int64_t kv_heads, const at::Tensor& o_w,
                                 const c10::optional<at::Tensor>& qkv_b, int64_t rot) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "attention_decode_bf16: x must be [1, H]");
  const AttnLayer<Bf16Proj> L = attention_layer(x.size(1), norm_w, qkv_w, q_norm, k_norm, k_cache, v_cache, k_scales, v_scales,
                                      heads, kv_heads, o_w, qkv_b, rot);
  TORCH_CHECK(pos >= 0 && pos < L.ctx, "attention_decode_bf16: pos outside the cache");
  TORCH_CHECK(cos.numel() == L.rot && sin.numel() == L.rot, "attention_decode_bf16: cos/sin must be [rotary dims]");
  static thread_local AttnScratch<Bf16Proj> scratch;
  at::Tensor y = at::empty({1, L.H}, x.options());
  attention_rows(L, bf16_data(x, "x"), bf16_data(cos, "cos"), bf16_data(sin, "sin"), pos, (float)eps, scratch,
                 reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

at::Tensor attention_decode_rows_bf16(const at::Tensor& x_in, const at::Tensor& norm_w, double eps,
                                      const at::Tensor& qkv_w, const at::Tensor& q_norm, const at::Tensor& k_norm,
                                      const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList k_caches,
                                      at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
                                      at::IntArrayRef pos, int64_t heads, int64_t kv_heads, const at::Tensor& o_w,
                                      const c10::optional<at::Tensor>& qkv_b, int64_t rot) {
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "attention_decode_rows_bf16: x must be [B, H], B >= 1");
  TORCH_CHECK(!k_caches.empty() && !k_scales.empty() && !v_scales.empty(),
              "attention_decode_rows_bf16: one K cache, V cache, K and V scales and position per row of x");
  // The layer's checks on row 0's caches; every row's own in attention_row_list.
  const AttnLayer<Bf16Proj> L = attention_layer(x.size(1), norm_w, qkv_w, q_norm, k_norm, k_caches[0], v_caches[0],
                                                k_scales[0], v_scales[0], heads, kv_heads, o_w, qkv_b, rot);
  at::Tensor y = at::empty({x.size(0), L.H}, x.options());
  const std::vector<AttnRow> rows = attention_row_list(x, cos, sin, k_caches, v_caches, k_scales, v_scales, pos,
                                                       kv_heads, L.D, y, "attention_decode_rows_bf16", L.rot);
  static thread_local AttnScratch<Bf16Proj> scratch;
  attention_batch(L, rows.data(), (int64_t)rows.size(), (float)eps, scratch);
  return y;
}

}  // namespace
TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("attention_decode_bf16(Tensor x, Tensor norm_w, float eps, Tensor qkv_w, Tensor q_norm, Tensor k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scales, Tensor(d!) v_scales, "
        "int pos, int heads, int kv_heads, "
        "Tensor o_w, Tensor? qkv_b=None, int rot=0) -> Tensor");
  m.def("attention_decode_rows_bf16(Tensor x, Tensor norm_w, float eps, Tensor qkv_w, Tensor q_norm, Tensor k_norm, "
        "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!)[] k_scales, "
        "Tensor(d!)[] v_scales, int[] pos, int heads, int kv_heads, Tensor o_w, Tensor? qkv_b=None, "
        "int rot=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("attention_decode_bf16", &attention_decode_bf16);
  m.impl("attention_decode_rows_bf16", &attention_decode_rows_bf16);
}
