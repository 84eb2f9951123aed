// Step 2 on the GPU, the token index: its launcher (kernels/cuda/token_index.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_moe {

// The most local experts the kernels take (their per-expert offsets in 48 KiB
// of shared memory).
constexpr int64_t kTokenIndexMaxLocalCuda = 12288;

// A stable counting sort of the n (< 2^31) flat entries of ids by local
// expert id - start_expert in [0, local), local <= kTokenIndexMaxLocalCuda:
// expert_sizes (local), src_to_dst (n; -1 for an entry of another rank's
// expert or an invalid id), dst_to_src (n; -1 past the last placed row).
// scratch: IndexScratchSize(n, local) ints (kernels/common/numeric.h).
// chained: launched right after another kernel of the same call (moe_layer),
// so that on sm_90+ the first kernel may start while that one finishes
// (programmatic dependent launch; it waits for it before reading ids).
cudaError_t LaunchTokenIndex(cudaStream_t stream, const int32_t* ids, int64_t n,
                             int64_t start_expert, int64_t local, int32_t* src_to_dst,
                             int32_t* dst_to_src, int32_t* expert_sizes, int32_t* scratch,
                             bool chained);

}  // namespace jax_moe
