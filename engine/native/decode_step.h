// The whole-step loop of one decode token, written once for the two ops that run it:
// decode_layers_bf16 (decode_step.cpp: bf16 projections, moe_bf16.h's fused layer) and
// decode_layers_int (decode_step_int.cpp: int8 / int4 projections, moe_int.h's). Per layer, the
// attention half (attention_rows, attention_kernels.h) then the caller's MoE layer, the hidden state
// handed between the halves in a thread's scratch; the two ops differ in their layers' kinds only
// (the projections' Proj, the MoE layer's rows), which the template and the caller's `moe` carry.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "attention_kernels.h"

namespace colibri_native {

// The step's operands checked, `op` naming the op in the message: x [1, H] (contiguous: the caller's
// copy), `per_layer` attention tensors and 3 MoE tensors a layer; returns the layer count.
inline int64_t step_layer_count(const at::Tensor& x, at::TensorList attention, at::TensorList moe, size_t per_layer,
                                const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, op, ": x must be [1, H]");
  TORCH_CHECK(attention.size() % per_layer == 0 && moe.size() % 3 == 0 && attention.size() / per_layer == moe.size() / 3,
              op, ": ", per_layer, " attention and 3 MoE tensors per layer");
  return (int64_t)moe.size() / 3;
}

// The checks of one layer's attention operands against the step's position and rope rows, `op`
// naming the op in the message (as its own checks do).
template <class Proj>
inline void check_step_layer(const AttnLayer<Proj>& L, int64_t pos, const at::Tensor& cos, const at::Tensor& sin,
                             const char* op) {
  TORCH_CHECK(pos >= 0 && pos < L.ctx, op, ": pos outside the cache");
  TORCH_CHECK(cos.numel() == L.D && sin.numel() == L.D, op, ": cos/sin must be [D]");
}

// y [1,H] = every layer in turn on x [1,H] (every layer checked by the caller before): attention_rows
// of att[l] reads `in` and writes mid, then moe(l, mid, y) runs layer l's MoE rows, reading mid and
// writing y; the next attention reads y. With no layers, y is a copy of x.
template <class Proj, class Moe>
inline at::Tensor run_step_layers(const at::Tensor& x, const std::vector<AttnLayer<Proj>>& att,
                                  const at::Tensor& cos, const at::Tensor& sin, int64_t pos, float eps, Moe&& moe) {
  static thread_local AttnScratch<Proj> attn_scratch;
  static thread_local std::vector<bf16> mid;  // the hidden state between the halves
  const int64_t H = x.size(1), layers = (int64_t)att.size();
  mid.resize(H);
  at::Tensor y = at::empty({1, H}, x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const bf16* cp = bf16_data(cos, "cos");
  const bf16* sp = bf16_data(sin, "sin");
  const bf16* in = bf16_data(x, "x");
  for (int64_t l = 0; l < layers; l++) {
    attention_rows(att[l], in, cp, sp, pos, eps, attn_scratch, mid.data());
    moe(l, static_cast<const bf16*>(mid.data()), yp);
    in = yp;
  }
  if (layers == 0) std::copy(in, in + H, yp);
  return y;
}


// The multi-row step's operands checked (decode_layers_rows_bf16 / decode_layers_int_rows, `op`
// naming it): x [M, H] (contiguous), `attention` C caches' step lists one after the other (each
// `per_layer` tensors a layer, the layer's weights then its 4 cache tensors last), 3 MoE tensors a
// layer, row_cache [M] (row r's cache, 0..C-1), positions [M], cos/sin [M, D]. Every cache's
// weights must be cache 0's own tensors (one model: they are read once, from cache 0's list).
// Returns (layers, C).
inline std::pair<int64_t, int64_t> rows_layer_count(const at::Tensor& x, at::TensorList attention, at::TensorList moe,
                                                    size_t per_layer, at::IntArrayRef row_cache,
                                                    at::IntArrayRef positions, const at::Tensor& cos,
                                                    const at::Tensor& sin, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, op, ": x must be [M, H], M >= 1");
  const int64_t M = x.size(0);
  TORCH_CHECK(moe.size() % 3 == 0 && !moe.empty(), op, ": 3 MoE tensors per layer, one layer at least");
  const int64_t layers = (int64_t)moe.size() / 3;
  TORCH_CHECK(attention.size() % (per_layer * layers) == 0 && !attention.empty(), op, ": ", per_layer,
              " attention tensors per layer per cache");
  const int64_t C = (int64_t)(attention.size() / (per_layer * layers));
  TORCH_CHECK((int64_t)row_cache.size() == M && (int64_t)positions.size() == M, op,
              ": one cache index and one position per row of x");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == M && cos.sizes() == sin.sizes(), op, ": cos/sin must be [M, D]");
  std::vector<int64_t> last(C, -1);  // per cache, the position of its latest row
  for (int64_t r = 0; r < M; r++) {
    TORCH_CHECK(row_cache[r] >= 0 && row_cache[r] < C, op, ": row ", r, ": cache index ", row_cache[r], " of ", C);
    TORCH_CHECK(positions[r] > last[row_cache[r]], op, ": row ", r,
                ": rows that share a cache must come in increasing positions");
    last[row_cache[r]] = positions[r];
  }
  const size_t weights = per_layer - 4;
  for (int64_t c = 1; c < C; c++)
    for (int64_t l = 0; l < layers; l++)
      for (size_t i = 0; i < weights; i++) {
        const at::Tensor &mine = attention[(c * layers + l) * per_layer + i], &first = attention[l * per_layer + i];
        TORCH_CHECK(mine.data_ptr() == first.data_ptr() && mine.sizes() == first.sizes(), op, ": cache ", c,
                    "'s list holds other weights than cache 0's (layer ", l, ")");
      }
  for (int64_t l = 0; l < layers; l++)  // distinct caches: distinct tensors (a row writes only its own)
    for (int64_t c = 0; c < C; c++)
      for (int64_t d = 0; d < c; d++)
        for (size_t i = weights; i < weights + 2; i++)
          for (size_t j = weights; j < weights + 2; j++)
            TORCH_CHECK(attention[(c * layers + l) * per_layer + i].data_ptr() !=
                            attention[(d * layers + l) * per_layer + j].data_ptr(),
                        op, ": caches ", d, " and ", c, " share a K/V tensor");
  return {layers, C};
}

// The rows' checks against their caches (each row's position inside its own cache) and the rope rows.
template <class Proj>
inline void check_rows(const std::vector<AttnLayer<Proj>>& att, int64_t layers, at::IntArrayRef row_cache,
                at::IntArrayRef positions, const at::Tensor& cos, const char* op) {
  for (size_t r = 0; r < row_cache.size(); r++)
    TORCH_CHECK(positions[r] >= 0 && positions[r] < att[row_cache[r] * layers].ctx, op, ": row ", r,
                ": position ", positions[r], " outside its cache");
  TORCH_CHECK(cos.size(1) == att[0].D, op, ": cos/sin must be [M, D]");
}


// y [M, H] = every layer in turn on x [M, H], row r one token at positions[r] of cache row_cache[r]
// (att[c * layers + l]: cache c's layer l; each row checked against its cache by the caller):
// per layer attention_batch of every row (the weights read once for all rows, each row's K/V written
// before any row attends, so rows sharing a cache see the earlier rows' K/V as one-at-a-time decoding
// does) then moe(l, mid rows, y rows). Each row's bits are run_step_layers' on that row alone: the
// batched functions give each row the one-row bits (attention_kernels.h, moe_bf16.h, moe_int.h).
template <class Proj, class Moe>
inline at::Tensor run_rows_layers(const at::Tensor& x, const std::vector<AttnLayer<Proj>>& att, int64_t layers,
                                  at::IntArrayRef row_cache, const at::Tensor& cos, const at::Tensor& sin,
                                  at::IntArrayRef positions, float eps, Moe&& moe) {
  static thread_local AttnScratch<Proj> attn_scratch;
  static thread_local std::vector<bf16> mid;
  static thread_local std::vector<AttnRow> rows;
  static thread_local std::vector<const bf16*> mid_rows;
  static thread_local std::vector<bf16*> y_rows;
  const int64_t M = x.size(0), H = x.size(1), D = cos.size(1);
  mid.resize(M * H), rows.resize(M), mid_rows.resize(M), y_rows.resize(M);
  at::Tensor y = at::empty({M, H}, x.options());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const bf16* cp = bf16_data(cos, "cos");
  const bf16* sp = bf16_data(sin, "sin");
  const bf16* in = bf16_data(x, "x");
  for (int64_t r = 0; r < M; r++) mid_rows[r] = mid.data() + r * H, y_rows[r] = yp + r * H;
  for (int64_t l = 0; l < layers; l++) {
    for (int64_t r = 0; r < M; r++) {
      const AttnLayer<Proj>& L = att[row_cache[r] * layers + l];
      rows[r] = {in + r * H, cp + r * D, sp + r * D, positions[r], L.k_cache, L.v_cache, mid.data() + r * H};
    }
    attention_batch(att[l], rows.data(), M, eps, attn_scratch);  // (cache 0's layer l: the weights)
    moe(l, static_cast<const bf16* const*>(mid_rows.data()), static_cast<bf16* const*>(y_rows.data()));
    in = yp;
  }
  return y;
}

}  // namespace colibri_native
