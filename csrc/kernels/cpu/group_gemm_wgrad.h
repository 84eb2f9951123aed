// The grouped GEMM's weight gradient on the CPU (group_gemm_wgrad.cc), for the
// group_gemm_wgrad handler: raw pointers, no XLA include.
#pragma once

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// dw[e] (d.n, d.k) = sum over the rows r of expert e of outer(dy[r], x_r), in
// DT (f32, bf16 or f16) with f32 accumulation: dy (d.m, d.n); x_r = x[r], or
// with `rows` (dst_to_src of a gather, d.m entries) x[rows[r] / topk], a zero
// row where rows[r] is outside [0, d.x_rows * topk). Expert e owns rows
// [min(P_e, d.m), min(P_{e+1}, d.m)), P the prefix sum of max(sizes, 0); an
// expert without rows gets zeros. Every output sums its rows in ascending
// order whichever thread computes it: the same bits for any pool. out holds
// d.groups x d.n x d.k elements. Instantiated for the three DTypes.
template <DType DT>
void GroupGemmWgrad(const TaskPool& pool, const void* dy, const void* x, const int32_t* sizes,
                    const GemmDims& d, const int32_t* rows, int64_t topk, void* out);

}  // namespace jax_moe
