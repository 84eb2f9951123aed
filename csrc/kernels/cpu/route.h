// Step 1 on the CPU, the router (kernels/cpu/route.cc).
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"
#include "kernels/common/routing.h"

namespace jax_moe {

// weights, ids (rows x o.k) = the top-k of each row of logits (rows x
// o.experts, `dtype`), bias (rows / o.tokens_per_batch rows of o.experts f32)
// in the choice when o.has_bias; the shape rules of CheckRoute hold. The rule
// is kernels/common/routing.h's, the same as the CUDA kernel's.
void RouteRows(DType dtype, const void* logits, const float* bias, int64_t rows,
               const RouteOptions& o, float* weights, int32_t* ids);

}  // namespace jax_moe
