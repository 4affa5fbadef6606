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

}  // namespace colibri_native
