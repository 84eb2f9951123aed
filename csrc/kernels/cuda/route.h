// Step 1 on the GPU, the router: its launcher (kernels/cuda/route.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/numeric.h"
#include "kernels/common/routing.h"

namespace jax_moe {

// The most experts the kernel takes (a warp's row of keys in shared memory;
// _checks.MAX_EXPERTS in Python).
constexpr int64_t kRouteMaxExpertsCuda = 3072;

// weights, ids (rows x o.k) = the top-k of each row of logits (rows x
// o.experts, `dtype`), bias (rows / o.tokens_per_batch rows of o.experts f32)
// in the choice when o.has_bias. o.experts <= kRouteMaxExpertsCuda and the
// shape rules of CheckRoute hold. On sm_90+ the kernel lets the next kernel of
// the stream start at once (programmatic dependent launch).
cudaError_t LaunchRoute(cudaStream_t stream, DType dtype, const void* logits, const float* bias,
                        int64_t rows, const RouteOptions& o, float* weights, int32_t* ids);

}  // namespace jax_moe
