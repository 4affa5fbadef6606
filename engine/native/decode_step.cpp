// Every layer of one bf16 decode step in one call: for each layer, the attention half
// (attention_kernels.h) then the fused MoE layer (moe_bf16.h), the hidden state handed from one to
// the next in C++ buffers (the loop: decode_step.h's run_step_layers, shared with decode_step_int.cpp).
//
// Why: with one native call per attention half and per MoE layer, a 16-layer step still made ~35
// Python-level calls (two per layer, each with its checks, dispatch and a fresh [1, H] tensor);
// while the interpreter ran, the cores streamed no weights. Here the step's layers are one call.
//
// Bits: the same inline functions as the per-layer ops, in the same order, so a step gives the
// same bits whichever way it runs (engine/arch/model.py takes this path only where every layer
// would have taken both per-layer ops).
//
// Op (namespace colibri):
//   decode_layers_bf16(x [1,H], attention, moe, cos [D], sin [D], pos, heads, kv_heads, eps, k, norm,
//       inter, reduction, threshold, renormalize) -> [1,H]   (the routing trim as moe_layer_bf16's)
//   attention: per layer (input norm [H], qkv [(Nq+2Nkv)D, H], q_norm [D]|[0], k_norm [D]|[0],
//       o_proj [H, Nq D], k_cache [Nkv,ctx,D], v_cache, k_scales [Nkv,ctx] | [0], v_scales), 9 tensors
//       a layer (the caches bf16 with empty scales, or int8 / e4m3 codes with their scales, as
//       attention_decode_bf16 takes them); moe: per layer
//       (post-attention norm [H], router [E,H], expert table int64 [E,3]), 3 a layer.
//   decode_layers_rows_bf16(x [M,H], attention, row_cache [M], moe, cos [M,D], sin [M,D], positions [M], heads,
//       kv_heads, eps, k, norm, inter, reduction, threshold, renormalize) -> [M,H]
//       M tokens through every layer in one call (a batched step's sequences, or a speculative verify's
//       consecutive positions of one cache): row r at positions[r] of cache row_cache[r]; attention holds
//       C caches' lists as decode_layers_bf16 takes one (the same weights in each, their own caches), one
//       after the other. Per layer the weights are read once for all rows (attention_batch, moe_batch)
//       and every row gets decode_layers_bf16's bits on that row alone; rows of one cache come in
//       increasing positions and each writes its K/V before a later row of that cache attends.

#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "attention_kernels.h"
#include "decode_step.h"
#include "moe_bf16.h"

namespace {

using namespace colibri_native;

at::Tensor decode_layers_bf16(const at::Tensor& x_in, at::TensorList attention, at::TensorList moe,
                              const at::Tensor& cos, const at::Tensor& sin, int64_t pos, int64_t heads,
                              int64_t kv_heads, double eps, int64_t k, bool norm, int64_t inter,
                              int64_t reduction, double threshold, bool renormalize) {
  const at::Tensor x = x_in.contiguous();
  const int64_t layers = step_layer_count(x, attention, moe, 9, "decode_layers_bf16"), H = x.size(1);
  const RoutingTrim trim{reduction, threshold, renormalize};
  std::vector<AttnLayer<Bf16Proj>> att(layers);
  std::vector<MoeLayer> mix(layers);
  for (int64_t l = 0; l < layers; l++) {  // every check before any layer runs
    const at::Tensor* a = &attention[9 * l];
    att[l] = attention_layer(H, a[0], a[1], a[2], a[3], a[5], a[6], a[7], a[8], heads, kv_heads, a[4]);
    check_step_layer(att[l], pos, cos, sin, "decode_layers_bf16");
    mix[l] = moe_layer(H, moe[3 * l], moe[3 * l + 1], moe[3 * l + 2], k, inter, trim);
  }
  static thread_local MoeScratch moe_scratch;
  return run_step_layers(x, att, cos, sin, pos, (float)eps, [&](int64_t l, const bf16* h, bf16* y) {
    moe_rows(mix[l], h, (float)eps, k, norm, trim, moe_scratch, y);
  });
}

at::Tensor decode_layers_rows_bf16(const at::Tensor& x_in, at::TensorList attention, at::IntArrayRef row_cache,
                                   at::TensorList moe, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   at::IntArrayRef positions, int64_t heads, int64_t kv_heads, double eps, int64_t k,
                                   bool norm, int64_t inter, int64_t reduction, double threshold, bool renormalize) {
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const char* op = "decode_layers_rows_bf16";
  const auto [layers, C] = rows_layer_count(x, attention, moe, 9, row_cache, positions, cos, sin, op);
  const int64_t H = x.size(1);
  const RoutingTrim trim{reduction, threshold, renormalize};
  std::vector<AttnLayer<Bf16Proj>> att(C * layers);
  std::vector<MoeLayer> mix(layers);
  for (int64_t c = 0; c < C; c++)  // every check before any layer runs
    for (int64_t l = 0; l < layers; l++) {
      const at::Tensor* a = &attention[9 * (c * layers + l)];
      att[c * layers + l] = attention_layer(H, a[0], a[1], a[2], a[3], a[5], a[6], a[7], a[8], heads, kv_heads, a[4]);
      TORCH_CHECK(att[c * layers + l].ctx == att[c * layers].ctx && att[c * layers + l].D == att[0].D, op,
                  ": cache ", c, ": every layer's cache of one size and head_dim");
    }
  check_rows(att, layers, row_cache, positions, cos, op);
  for (int64_t l = 0; l < layers; l++) mix[l] = moe_layer(H, moe[3 * l], moe[3 * l + 1], moe[3 * l + 2], k, inter, trim);
  static thread_local MoeBatchScratch moe_scratch;
  const int64_t M = x.size(0);
  return run_rows_layers(x, att, layers, row_cache, cos, sin, positions, (float)eps,
                         [&](int64_t l, const bf16* const* h, bf16* const* y) {
                           moe_batch(mix[l], h, M, (float)eps, k, norm, trim, moe_scratch, y);
                         });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) {
  m.def("decode_layers_bf16(Tensor x, Tensor[] attention, Tensor[] moe, Tensor cos, Tensor sin, int pos, int heads, "
        "int kv_heads, float eps, int k, bool norm, int inter, int reduction=0, float threshold=0., "
        "bool renormalize=False) -> Tensor");
  m.def("decode_layers_rows_bf16(Tensor x, Tensor[] attention, int[] row_cache, Tensor[] moe, Tensor cos, Tensor sin, "
        "int[] positions, int heads, int kv_heads, float eps, int k, bool norm, int inter, int reduction=0, "
        "float threshold=0., bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
  m.impl("decode_layers_bf16", &decode_layers_bf16);
  m.impl("decode_layers_rows_bf16", &decode_layers_rows_bf16);
}
