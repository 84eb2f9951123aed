// Step 3 on the GPU, expand: its launcher (kernels/cuda/expand.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe {

// out[i] = x[dst_to_src[i] / topk] for the m rows of out (rows of row_bytes
// bytes, x has `tokens` of them); a row whose entry names no token row
// (ExpandSourceRow: outside [0, tokens * topk)) is zero.
cudaError_t LaunchExpand(cudaStream_t stream, const void* x, int64_t tokens, int64_t row_bytes,
                         const int32_t* dst_to_src, int64_t m, int64_t topk, void* out);

}  // namespace jax_moe
