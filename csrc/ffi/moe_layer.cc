// The moe_layer handlers (ops.moe_layer): the routed layer in one call, the
// handlers of route, token index, expert_mlp and combine one after the other
// (csrc/ffi/layer_steps.h), each with its own checks, so the bits are those
// of the four ops.
//
// On the GPU, on compute capability 9.0+, every kernel after the router is
// launched with programmatic dependent launch, so that it starts while the
// one before it finishes: under XLA's command buffers that edge only exists
// between kernels of one custom call, and separate ops' calls pay a full
// kernel-to-kernel gap at each of their three boundaries (docs/performance.md).
// Every kernel waits for its predecessor before it reads what this call
// wrote, and every block waits before it exits, so each wait covers all the
// kernels before it. Where Python sizes the last scratch output for them (two
// ints), GEMMs at tile 256 run the own Hopper kernel in the chain
// (expert_mlp.cc).
#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"
#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jax_moe {
namespace {

ffi::Error MoeLayerCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer logits, F32In bias,
                       ffi::AnyBuffer w13, ffi::AnyBuffer w2, bool renormalize, int64_t scoring,
                       int64_t num_expert_group, int64_t topk_group, bool has_bias,
                       float routed_scaling_factor, int64_t activation, bool gated,
                       int64_t tile_m1, int64_t tile_m2, AnyOut out, F32Out weights, S32Out ids,
                       S32Out src_to_dst, S32Out dst_to_src, S32Out sizes, S32Out scratch,
                       AnyOut y, AnyOut h, AnyOut a, S32Out) {
  if (auto e = RouteCpu(logits, bias, renormalize, scoring, num_expert_group, topk_group,
                        has_bias, routed_scaling_factor, weights, ids);
      e.failure())
    return e;
  const int64_t topk = LastDim(weights->dimensions());
  const int64_t experts = LastDim(logits.dimensions());
  if (auto e = TokenIndexCpu(*ids, experts, 0, src_to_dst, dst_to_src, sizes, scratch);
      e.failure())
    return e;
  if (auto e = ExpertMlpCpu(PoolOf(pool), x, w13, w2, *sizes, *dst_to_src, topk, activation, gated,
                            tile_m1, tile_m2, y, h, a);
      e.failure())
    return e;
  return CombineCpu(*y, *weights, *src_to_dst, out);
}

#ifdef JAX_MOE_WITH_CUDA
ffi::Error MoeLayerCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer logits, F32In bias,
                        ffi::AnyBuffer w13, ffi::AnyBuffer w2, bool renormalize, int64_t scoring,
                        int64_t num_expert_group, int64_t topk_group, bool has_bias,
                        float routed_scaling_factor, int64_t activation, bool gated,
                        int64_t tile_m1, int64_t tile_m2, AnyOut out, F32Out weights, S32Out ids,
                        S32Out src_to_dst, S32Out dst_to_src, S32Out sizes, S32Out scratch,
                        AnyOut y, AnyOut h, AnyOut a, [[maybe_unused]] S32Out counters) {
  // The own Hopper kernel's tile counters, zeroed before the router: a
  // memset between two kernels would cut their programmatic dependent launch.
  int* tile_counters = nullptr;
#ifdef JAX_MOE_WITH_SM90
  if (counters->element_count() >= 2) {
    tile_counters = counters->typed_data();
    if (auto e = CudaError(cudaMemsetAsync(tile_counters, 0, 2 * sizeof(int32_t), stream),
                           "moe_layer counters");
        e.failure())
      return e;
  }
#endif
  if (auto e = RouteCuda(stream, logits, bias, renormalize, scoring, num_expert_group,
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
                              tile_m1, tile_m2, y, h, a, true, tile_counters);
      e.failure())
    return e;
  return CombineSteps(stream, *y, *weights, *src_to_dst, out, true);
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kMoeLayerCpu, MoeLayerCpu,
                              MoeLayerSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

#ifdef JAX_MOE_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kMoeLayerCuda, MoeLayerCuda,
    MoeLayerSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
