// Step 7 on the CPU, the weighted combine (kernels/cpu/combine.cc).
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// out[t] = sum over j of w[t, j] * y[src_to_dst[t * k + j]] for the tokens
// rows of out (hidden wide, `dtype`), f32 sums in slot order; an entry
// outside [0, m) (y's rows) counts as zero.
void CombineRows(DType dtype, const void* y, const float* w, const int32_t* src_to_dst,
                 int64_t tokens, int64_t k, int64_t m, int64_t hidden, void* out);

}  // namespace jax_moe
