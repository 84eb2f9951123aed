// The token_index target (ops.moe_compute_token_index): step 2 on the CPU
// (kernels/cpu/token_index.h) and the GPU (kernels/cuda/token_index.h).
#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/shape_checks.h"
#include "ffi/targets.h"
#include "kernels/cpu/token_index.h"

#ifdef JAX_MOE_WITH_CUDA
#include "kernels/cuda/token_index.h"
#endif

namespace jax_moe {

ffi::Error TokenIndexCpu(S32In topk_ids, int64_t num_experts, int64_t start_expert,
                         S32Out src_to_dst, S32Out dst_to_src, S32Out expert_sizes,
                         S32Out /*scratch*/) {
  if (auto err = CheckTokenIndex(topk_ids, num_experts, start_expert, *src_to_dst, *dst_to_src,
                                 *expert_sizes);
      err.failure())
    return err;
  ComputeTokenIndex(topk_ids.typed_data(), topk_ids.element_count(), start_expert,
                    expert_sizes->element_count(), src_to_dst->typed_data(),
                    dst_to_src->typed_data(), expert_sizes->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTokenIndexCpu, TokenIndexCpu, TokenIndexSignature(ffi::Ffi::Bind()));

#ifdef JAX_MOE_WITH_CUDA
ffi::Error TokenIndexSteps(cudaStream_t stream, S32In topk_ids, int64_t num_experts,
                           int64_t start_expert, S32Out src_to_dst, S32Out dst_to_src,
                           S32Out expert_sizes, S32Out scratch, bool chained) {
  if (auto err = CheckTokenIndex(topk_ids, num_experts, start_expert, *src_to_dst, *dst_to_src,
                                 *expert_sizes);
      err.failure())
    return err;
  const int64_t n = topk_ids.element_count();
  const int64_t local = expert_sizes->element_count();
  const int64_t chunks = (n + kIndexChunk - 1) / kIndexChunk;
  if (static_cast<int64_t>(scratch->element_count()) < IndexScratchSize(n, local))
    return InvalidArg("moe_compute_token_index: scratch buffer too small");
  if (local > kTokenIndexMaxLocalCuda)
    return InvalidArg("moe_compute_token_index: at most 12288 local experts on CUDA");
  if (chunks > 0x7fffffff) return InvalidArg("moe_compute_token_index: too many entries");
  return CudaError(LaunchTokenIndex(stream, topk_ids.typed_data(), n, start_expert, local,
                                    src_to_dst->typed_data(), dst_to_src->typed_data(),
                                    expert_sizes->typed_data(), scratch->typed_data(), chained),
                   "moe_compute_token_index launch");
}

namespace {

ffi::Error TokenIndexCuda(cudaStream_t stream, S32In topk_ids, int64_t num_experts,
                          int64_t start_expert, S32Out src_to_dst, S32Out dst_to_src,
                          S32Out expert_sizes, S32Out scratch) {
  return TokenIndexSteps(stream, topk_ids, num_experts, start_expert, src_to_dst, dst_to_src,
                         expert_sizes, scratch, false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kTokenIndexCuda, TokenIndexCuda,
    TokenIndexSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
#endif

}  // namespace jax_moe
