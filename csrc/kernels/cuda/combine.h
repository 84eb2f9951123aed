// Step 7 on the GPU, the weighted combine: its launcher (kernels/cuda/combine.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// out[t] = sum over j of weights[t, j] * y[src_to_dst[t * k + j]] for the
// tokens rows of out (hidden wide, `dtype`), f32 sums in slot order (bitwise
// reproducible); an entry outside [0, m) (y's rows) counts as zero. chained:
// launched right after another kernel of the same call (moe_layer), so that
// on sm_90+ it may start while that one finishes (it waits for it before
// reading anything).
cudaError_t LaunchCombine(cudaStream_t stream, DType dtype, const void* y, const float* weights,
                          const int32_t* src_to_dst, int64_t tokens, int64_t k, int64_t m,
                          int64_t hidden, void* out, bool chained);

}  // namespace jax_moe
