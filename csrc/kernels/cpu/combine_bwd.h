// The backward of step 7 on the CPU (kernels/cpu/combine_bwd.cc).
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// The combine's gradients for its output cotangent g (tokens x hidden,
// `dtype`), slots = tokens * k:
//   dy[r]    = w[i] * g[i / k] for i = dst_to_src[r] when i is in [0, slots)
//              and src_to_dst[i] == r, else a zero row (m rows, `dtype`; f32
//              product rounded once);
//   dw[t, j] = sum over h of y[r, h] * g[t, h] (f32, h in order) for
//              r = src_to_dst[t * k + j] in [0, m), else 0.
// Work is split over `pool`; each output element has one writer and a fixed
// order, so the result does not depend on the pool.
void CombineBwdRows(const TaskPool& pool, DType dtype, const void* g, const void* y,
                    const float* w, const int32_t* src_to_dst, const int32_t* dst_to_src,
                    int64_t tokens, int64_t k, int64_t m, int64_t hidden, void* dy, float* dw);

}  // namespace jax_moe
