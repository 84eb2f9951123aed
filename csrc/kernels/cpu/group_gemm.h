// Steps 4 and 6 on the CPU (csrc/kernels/cpu/group_gemm.cc), for the
// group_gemm, expert_mlp and moe_layer handlers: raw pointers, no XLA include.
#pragma once

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// out[rows of group e] = x[rows of e] @ w[e]^T in DT (f32, bf16 or f16) with
// f32 accumulation; rows past sum(sizes) are zero. Negative sizes count as 0
// and groups are clamped to d.m. rows: dst_to_src of a fused gather (row r of
// the input is x[rows[r] / topk], zero when outside [0, d.x_rows * topk)), or
// null. Work is split over `pool`; every output is one dot product over all
// of K, so the bits do not depend on the number of threads. Instantiated for
// the three DTypes in group_gemm.cc.
template <DType DT>
void GroupGemm(const TaskPool& pool, const void* x, const void* w, const int32_t* sizes,
               const GemmDims& d, const int32_t* rows, int64_t topk, void* out);

}  // namespace jax_moe
