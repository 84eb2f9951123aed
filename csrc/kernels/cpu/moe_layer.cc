// The routed layer in one call on the CPU (ops.moe_layer): the handlers of
// route, token index, expert_mlp and combine one after the other, so the
// bits are those of the four ops.
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"

namespace jax_moe {
namespace {

ffi::Error MoeLayerCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer logits, F32In bias,
                       ffi::AnyBuffer w13, ffi::AnyBuffer w2, bool renormalize, int64_t scoring,
                       int64_t num_expert_group, int64_t topk_group, bool has_bias,
                       float routed_scaling_factor, int64_t activation, bool gated,
                       int64_t tile_m1, int64_t tile_m2, AnyOut out, F32Out weights, S32Out ids,
                       S32Out src_to_dst, S32Out dst_to_src, S32Out sizes, S32Out scratch,
                       AnyOut y, AnyOut h, AnyOut a) {
  if (auto e = TopkSoftmaxCpu(logits, bias, renormalize, scoring, num_expert_group, topk_group,
                              has_bias, routed_scaling_factor, weights, ids);
      e.failure())
    return e;
  const int64_t topk = LastDim(weights->dimensions());
  const int64_t experts = LastDim(logits.dimensions());
  if (auto e = TokenIndexCpu(*ids, experts, 0, src_to_dst, dst_to_src, sizes, scratch);
      e.failure())
    return e;
  if (auto e = ExpertMlpCpu(pool, x, w13, w2, *sizes, *dst_to_src, topk, activation, gated,
                            tile_m1, tile_m2, y, h, a);
      e.failure())
    return e;
  return CombineCpu(*y, *weights, *src_to_dst, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeLayerCpu, MoeLayerCpu,
                              MoeLayerSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace jax_moe
