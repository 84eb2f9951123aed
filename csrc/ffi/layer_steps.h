// The handlers that moe_layer (csrc/ffi/moe_layer.cc) runs one after
// another: each op's own handler, with its own checks, defined in the op's
// csrc/ffi/<step>.cc. The CUDA ones take `chained`: launched inside the
// moe_layer call right after the step before it, so that on compute
// capability 9.0+ their kernels may start while that step finishes
// (programmatic dependent launch; every kernel waits for its predecessor
// before it reads anything this call wrote).
#pragma once

#include "ffi/ffi_common.h"

#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jax_moe {

using S32In = ffi::Buffer<ffi::S32>;
using S32Out = ffi::Result<ffi::Buffer<ffi::S32>>;
using F32In = ffi::Buffer<ffi::F32>;
using F32Out = ffi::Result<ffi::Buffer<ffi::F32>>;
using AnyOut = ffi::Result<ffi::AnyBuffer>;

ffi::Error RouteCpu(ffi::AnyBuffer logits, F32In bias, bool renormalize, int64_t scoring,
                    int64_t num_expert_group, int64_t topk_group, bool has_bias,
                    float routed_scaling_factor, F32Out weights, S32Out ids);
ffi::Error TokenIndexCpu(S32In topk_ids, int64_t num_experts, int64_t start_expert,
                         S32Out src_to_dst, S32Out dst_to_src, S32Out expert_sizes,
                         S32Out scratch);
// expert_mlp on the CPU, its work split over `pool` (the handler's is
// PoolOf(XLA's intra-op pool)).
ffi::Error ExpertMlpCpu(const TaskPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                        ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                        int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                        AnyOut out, AnyOut h, AnyOut a);
ffi::Error CombineCpu(ffi::AnyBuffer y, F32In weights, S32In src_to_dst, AnyOut out);

#ifdef JAX_MOE_WITH_CUDA
// The router is the call's first kernel (launched as usual); it lets the next
// kernel start at once.
ffi::Error RouteCuda(cudaStream_t stream, ffi::AnyBuffer logits, F32In bias, bool renormalize,
                     int64_t scoring, int64_t num_expert_group, int64_t topk_group,
                     bool has_bias, float routed_scaling_factor, F32Out weights, S32Out ids);
ffi::Error TokenIndexSteps(cudaStream_t stream, S32In topk_ids, int64_t num_experts,
                           int64_t start_expert, S32Out src_to_dst, S32Out dst_to_src,
                           S32Out expert_sizes, S32Out scratch, bool chained);
// counters: two device ints zeroed earlier on the stream (moe_layer), or
// null; see expert_mlp.cc.
ffi::Error ExpertMlpSteps(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w13,
                          ffi::AnyBuffer w2, S32In expert_sizes, S32In rows, int64_t topk,
                          int64_t activation, bool gated, int64_t tile_m1, int64_t tile_m2,
                          AnyOut out, AnyOut h, AnyOut a, bool chained, int* counters);
ffi::Error CombineSteps(cudaStream_t stream, ffi::AnyBuffer y, F32In weights, S32In src_to_dst,
                        AnyOut out, bool chained);
#endif

}  // namespace jax_moe
