// The routed layer in one call on the GPU (ops.moe_layer): the router, the
// token index, expert_mlp's three kernels and the combine, each through its
// op's own handler. On compute capability 9.0+ every kernel after the
// router is launched with programmatic dependent launch, so that it starts
// while the one before it finishes: under XLA's command buffers that edge
// only exists between kernels of one custom call, and the separate ops' calls
// paid a full kernel-to-kernel gap at each of their three boundaries
// (scripts/pdl_bench.cu measured 1.3-2.3 us per edge).
// Every kernel waits for its predecessor before it reads what this call
// wrote, and every block waits before it exits, so each wait covers all the
// kernels before it.
#include "kernels/cuda/cuda_common.cuh"
#include "ffi/layer_steps.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"

namespace jax_moe {
namespace {

ffi::Error MoeLayerCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer logits, F32In bias,
                        ffi::AnyBuffer w13, ffi::AnyBuffer w2, bool renormalize, int64_t scoring,
                        int64_t num_expert_group, int64_t topk_group, bool has_bias,
                        float routed_scaling_factor, int64_t activation, bool gated,
                        int64_t tile_m1, int64_t tile_m2, AnyOut out, F32Out weights, S32Out ids,
                        S32Out src_to_dst, S32Out dst_to_src, S32Out sizes, S32Out scratch,
                        AnyOut y, AnyOut h, AnyOut a) {
  if (auto e = TopkSoftmaxCuda(stream, logits, bias, renormalize, scoring, num_expert_group,
                               topk_group, has_bias, routed_scaling_factor, weights, ids);
      e.failure())
    return e;
  const int64_t topk = LastDim(weights->dimensions());
  const int64_t experts = LastDim(logits.dimensions());
  if (auto e = TokenIndexSteps(stream, *ids, experts, 0, src_to_dst, dst_to_src, sizes, scratch,
                               true);
      e.failure())
    return e;
  if (auto e = ExpertMlpSteps(stream, x, w13, w2, *sizes, *dst_to_src, topk, activation, gated,
                              tile_m1, tile_m2, y, h, a, true);
      e.failure())
    return e;
  return CombineSteps(stream, *y, *weights, *src_to_dst, out, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kMoeLayerCuda, MoeLayerCuda,
    MoeLayerSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
