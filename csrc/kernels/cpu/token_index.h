// Step 2 on the CPU, the token index (kernels/cpu/token_index.cc).
#pragma once

#include <cstdint>

namespace jax_moe {

// A stable counting sort of the n flat (token, slot) entries of ids by local
// expert id - start_expert in [0, local): expert_sizes (local), src_to_dst (n;
// -1 for an entry of another rank's expert or an invalid id) and dst_to_src
// (n; -1 past the last placed row).
void ComputeTokenIndex(const int32_t* ids, int64_t n, int64_t start_expert, int64_t local,
                       int32_t* src_to_dst, int32_t* dst_to_src, int32_t* expert_sizes);

}  // namespace jax_moe
