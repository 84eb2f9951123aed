// Step 3 on the CPU, expand (kernels/cpu/expand.cc).
#pragma once

#include <cstdint>

namespace jax_moe {

// out[i] = x[dst_to_src[i] / topk] for the m rows of out (rows of row_bytes
// bytes); a row whose entry names no token row of x (ExpandSourceRow: outside
// [0, tokens * topk)) is zero.
void ExpandRows(const void* x, int64_t tokens, int64_t row_bytes, const int32_t* dst_to_src,
                int64_t m, int64_t topk, void* out);

}  // namespace jax_moe
