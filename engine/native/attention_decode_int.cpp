// The attention half of a decoder layer for one decode token (T == 1) in one call, with int8 or
// int4 group-wise q/k/v/o projections (containers converted with `--scope all`): the quantized twin
// of attention_decode_bf16 (attention_decode.cpp).
//
// Why: a scope-all layer's attention ran in torch-level steps (four int linear ops, the per-head
// norms, rope, the cache writes and SDPA, ~40 operators with their dispatch and Python between
// them) while a bf16 layer's ran in one native call; this is that call for QuantWeight projections.
//
// Bits: the norm, per-head norms, rope, cache write and attention are attention_rows' (the bf16
// op's, so the same roundings); the projections are the int linear op's bits (attention_int.h: the
// input row quantized once per call as int_decode.cpp's linear does, each output rounded once to
// bf16), so q/k/v, the K/V rows written (bf16 or, for kv_dtype int8 / fp8, their codes and scales)
// and o_proj's output match the unfused path exactly given the same inputs; the attention itself
// sums in another order than SDPA (close, not bit-equal, as for bf16).
//
// Op (namespace colibri_int; VNNI/VBMI: engine/native/__init__.py calls it only where INT_FLAGS are present):
//   attention_decode_int(x [1,H], norm_w [H], eps, proj, group, q_norm [D] | [0], k_norm [D] | [0],
//       cos [D], sin [D], k_cache [Nkv,ctx,D], v_cache, k_scales [Nkv,ctx] | [0], v_scales, pos, heads,
//       kv_heads) -> [1, H]
//   proj: (q, k, v, o) codes and scales in the stored layouts (8 tensors: int8 codes [N, K] + scales
//   [N], or int4 packed [N, K/2] + scales_zeros [K/g, N, 2]); group 0 = int8, else int4 of that
//   group. The caches as attention_decode_bf16 takes them; writes [:, pos] and attends 0..pos.
//   attention_decode_int_rows(x [B,H], norm_w, eps, proj, group, q_norm, k_norm, cos [B,D], sin [B,D],
//       k_caches [B], v_caches [B], k_scales [B], v_scales [B], pos int[B], heads, kv_heads) -> [B, H]
//   B rows of a batched step as attention_decode_rows_bf16 takes them: each projection's weights
//   read once for all rows (each row quantized on its own), row r bit for bit attention_decode_int
//   on row r alone.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "attention_int.h"

COLIBRI_INT_TARGET_BEGIN

namespace {

using namespace colibri_int_kernels;

at::Tensor attention_decode_int(const at::Tensor& x_in, const at::Tensor& norm_w, double eps, at::TensorList proj,
                                int64_t group, const at::Tensor& q_norm, const at::Tensor& k_norm,
                                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& k_scales, const at::Tensor& v_scales,
                                int64_t pos, int64_t heads, int64_t kv_heads) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "attention_decode_int: x must be [1, H]");
  TORCH_CHECK(proj.size() == 8, "attention_decode_int: proj holds q, k, v, o codes and scales (8 tensors)");
  const AttnLayer<QuantProj> L = attention_layer_int(x.size(1), norm_w, q_norm, k_norm, proj.data(), group, k_cache,
                                                     v_cache, k_scales, v_scales, heads, kv_heads);
  TORCH_CHECK(pos >= 0 && pos < L.ctx, "attention_decode_int: pos outside the cache");
  TORCH_CHECK(cos.numel() == L.D && sin.numel() == L.D, "attention_decode_int: cos/sin must be [D]");
  static thread_local AttnScratch<QuantProj> scratch;
  at::Tensor y = at::empty({1, L.H}, x.options());
  attention_rows(L, bf16_data(x, "x"), bf16_data(cos, "cos"), bf16_data(sin, "sin"), pos, (float)eps, scratch,
                 reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

at::Tensor attention_decode_int_rows(const at::Tensor& x_in, const at::Tensor& norm_w, double eps, at::TensorList proj,
                                     int64_t group, const at::Tensor& q_norm, const at::Tensor& k_norm,
                                     const at::Tensor& cos_in, const at::Tensor& sin_in, at::TensorList k_caches,
                                     at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
                                     at::IntArrayRef pos, int64_t heads, int64_t kv_heads) {
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "attention_decode_int_rows: x must be [B, H], B >= 1");
  TORCH_CHECK(proj.size() == 8, "attention_decode_int_rows: proj holds q, k, v, o codes and scales (8 tensors)");
  TORCH_CHECK(!k_caches.empty() && !k_scales.empty() && !v_scales.empty(),
              "attention_decode_int_rows: one K cache, V cache, K and V scales and position per row of x");
  const AttnLayer<QuantProj> L = attention_layer_int(x.size(1), norm_w, q_norm, k_norm, proj.data(), group,
                                                     k_caches[0], v_caches[0], k_scales[0], v_scales[0], heads,
                                                     kv_heads);
  at::Tensor y = at::empty({x.size(0), L.H}, x.options());
  const std::vector<AttnRow> rows = attention_row_list(x, cos, sin, k_caches, v_caches, k_scales, v_scales, pos,
                                                       kv_heads, L.D, y, "attention_decode_int_rows");
  static thread_local AttnScratch<QuantProj> scratch;
  attention_batch(L, rows.data(), (int64_t)rows.size(), (float)eps, scratch);
  return y;
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY_FRAGMENT(colibri_int, m) {
  m.def("attention_decode_int(Tensor x, Tensor norm_w, float eps, Tensor[] proj, int group, Tensor q_norm, "
        "Tensor k_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scales, "
        "Tensor(d!) v_scales, int pos, int heads, int kv_heads) -> Tensor");
  m.def("attention_decode_int_rows(Tensor x, Tensor norm_w, float eps, Tensor[] proj, int group, Tensor q_norm, "
        "Tensor k_norm, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor(c!)[] k_scales, Tensor(d!)[] v_scales, int[] pos, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) {
  m.impl("attention_decode_int", &attention_decode_int);
  m.impl("attention_decode_int_rows", &attention_decode_int_rows);
}
