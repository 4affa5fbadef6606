// Every layer of one decode step in one call for a container whose projections and routed experts
// are all int8 or int4 group-wise (`--scope all`): per layer the attention half with quantized
// projections (attention_int.h) then the fused int MoE layer (moe_int.h), the quantized twin of
// decode_layers_bf16 (decode_step.cpp), whose loop it shares (decode_step.h's run_step_layers).
//
// Why: with one native call per attention half and per MoE layer a step is still two
// Python-level calls a layer, each with its checks, dispatch and a fresh [1, H] tensor, and the
// cores stream no weights while the interpreter runs; here the step's layers are one call.
//
// Bits: the same inline functions as the per-layer ops (attention_decode_int, moe_layer_int), in
// the same order, so a step gives the same bits whichever way it runs (engine/arch/model.py takes
// this path only where every layer would have taken both per-layer ops).
//
// Op (namespace colibri_int; VNNI/VBMI, as every op of this namespace):
//   decode_layers_int(x [1,H], attention, moe, cos [D], sin [D], pos, heads, kv_heads, eps, k, norm, inter,
//       attn_group, moe_group, reduction, threshold, renormalize) -> [1,H]   (the trim as moe_layer_int's)
//   attention: per layer (input norm [H], q_norm [D]|[0], k_norm [D]|[0], q/k/v/o codes and scales (8
//       tensors, attn_group's kind), k_cache, v_cache, k_scales | [0], v_scales), 15 tensors a layer;
//   moe: per layer (post-attention norm [H], router [E,H], expert table int64 [E,6], moe_group's kind), 3.
//   decode_layers_int_rows(x [M,H], attention, row_cache [M], moe, cos [M,D], sin [M,D], positions [M], heads,
//       kv_heads, eps, k, norm, inter, attn_group, moe_group, reduction, threshold, renormalize) -> [M,H]
//       M tokens in one call, as decode_layers_rows_bf16 (decode_step.cpp) takes them: each row
//       decode_layers_int's bits alone, each projection and expert unit read once for all rows.

#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "attention_int.h"
#include "decode_step.h"
#include "moe_int.h"

COLIBRI_INT_TARGET_BEGIN

namespace {

using namespace colibri_int_kernels;

constexpr size_t ATTENTION_TENSORS = 15;

at::Tensor decode_layers_int(const at::Tensor& x_in, at::TensorList attention, at::TensorList moe,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t pos, int64_t heads,
                             int64_t kv_heads, double eps, int64_t k, bool norm, int64_t inter, int64_t attn_group,
                             int64_t moe_group, int64_t reduction, double threshold, bool renormalize) {
  const at::Tensor x = x_in.contiguous();
  const int64_t layers = step_layer_count(x, attention, moe, ATTENTION_TENSORS, "decode_layers_int"), H = x.size(1);
  const RoutingTrim trim{reduction, threshold, renormalize};
  std::vector<AttnLayer<QuantProj>> att(layers);
  std::vector<MoeIntLayer> mix(layers);
  for (int64_t l = 0; l < layers; l++) {  // every check before any layer runs
    const at::Tensor* a = &attention[ATTENTION_TENSORS * l];
    att[l] = attention_layer_int(H, a[0], a[1], a[2], a + 3, attn_group, a[11], a[12], a[13], a[14], heads, kv_heads);
    check_step_layer(att[l], pos, cos, sin, "decode_layers_int");
    mix[l] = moe_int_layer(H, moe[3 * l], moe[3 * l + 1], moe[3 * l + 2], k, inter, moe_group, trim);
  }
  static thread_local MoeIntScratch moe_scratch;
  return run_step_layers(x, att, cos, sin, pos, (float)eps, [&](int64_t l, const bf16* h, bf16* y) {
    moe_int_rows(mix[l], h, (float)eps, k, norm, trim, moe_scratch, y);
  });
}

at::Tensor decode_layers_int_rows(const at::Tensor& x_in, at::TensorList attention, at::IntArrayRef row_cache,
                                  at::TensorList moe, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                  at::IntArrayRef positions, int64_t heads, int64_t kv_heads, double eps, int64_t k,
                                  bool norm, int64_t inter, int64_t attn_group, int64_t moe_group, int64_t reduction,
                                  double threshold, bool renormalize) {
  const at::Tensor x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const char* op = "decode_layers_int_rows";
  const auto [layers, C] = rows_layer_count(x, attention, moe, ATTENTION_TENSORS, row_cache, positions, cos, sin, op);
  const int64_t H = x.size(1);
  const RoutingTrim trim{reduction, threshold, renormalize};
  std::vector<AttnLayer<QuantProj>> att(C * layers);
  std::vector<MoeIntLayer> mix(layers);
  for (int64_t c = 0; c < C; c++)  // every check before any layer runs
    for (int64_t l = 0; l < layers; l++) {
      const at::Tensor* a = &attention[ATTENTION_TENSORS * (c * layers + l)];
      att[c * layers + l] =
          attention_layer_int(H, a[0], a[1], a[2], a + 3, attn_group, a[11], a[12], a[13], a[14], heads, kv_heads);
      TORCH_CHECK(att[c * layers + l].ctx == att[c * layers].ctx && att[c * layers + l].D == att[0].D, op,
                  ": cache ", c, ": every layer's cache of one size and head_dim");
    }
  check_rows(att, layers, row_cache, positions, cos, op);
  for (int64_t l = 0; l < layers; l++)
    mix[l] = moe_int_layer(H, moe[3 * l], moe[3 * l + 1], moe[3 * l + 2], k, inter, moe_group, trim);
  static thread_local MoeIntBatchScratch moe_scratch;
  const int64_t M = x.size(0);
  return run_rows_layers(x, att, layers, row_cache, cos, sin, positions, (float)eps,
                         [&](int64_t l, const bf16* const* h, bf16* const* y) {
                           moe_int_batch(mix[l], h, M, (float)eps, k, norm, trim, moe_scratch, y);
                         });
}

}  // namespace

COLIBRI_INT_TARGET_END

TORCH_LIBRARY_FRAGMENT(colibri_int, m) {
  m.def("decode_layers_int(Tensor x, Tensor[] attention, Tensor[] moe, Tensor cos, Tensor sin, int pos, int heads, "
        "int kv_heads, float eps, int k, bool norm, int inter, int attn_group, int moe_group, int reduction=0, "
        "float threshold=0., bool renormalize=False) -> Tensor");
  m.def("decode_layers_int_rows(Tensor x, Tensor[] attention, int[] row_cache, Tensor[] moe, Tensor cos, Tensor sin, "
        "int[] positions, int heads, int kv_heads, float eps, int k, bool norm, int inter, int attn_group, "
        "int moe_group, int reduction=0, float threshold=0., bool renormalize=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri_int, CPU, m) {
  m.impl("decode_layers_int", &decode_layers_int);
  m.impl("decode_layers_int_rows", &decode_layers_int_rows);
}
