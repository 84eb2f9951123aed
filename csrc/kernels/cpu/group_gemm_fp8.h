// The fp8 grouped GEMM on the CPU (csrc/kernels/cpu/group_gemm_fp8.cc), for
// the group_gemm_fp8 handler: raw pointers, no XLA include.
#pragma once

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// out[rows of group e] = q(x[rows of e]) @ (w[e] x w_scale[e])^T in DT with
// f32 accumulation, the block-scaled recipe of kernels/common/fp8_e4m3.h:
// each row of x (DT) quantised to e4m3 per 128 channels; w (groups, n, k)
// e4m3 codes with one f32 scale per 128 x 128 block, w_scale (groups,
// ceil(n/128), ceil(k/128)); per 128-channel block b, the e4m3 products are
// summed in f32, then the sum times x's scale times w's is added. Rows past
// sum(sizes) are zero; sizes are clamped as in GroupGemm. With `rows`
// (dst_to_src of a gather, d.m entries), row r of x is x[rows[r] / topk] (x
// (d.x_rows, k)), a zero row outside [0, d.x_rows * topk). Every output is
// computed by one thread in a fixed order. Instantiated for the three DTypes.
template <DType DT>
void GroupGemmFp8(const TaskPool& pool, const void* x, const uint8_t* w, const float* w_scale,
                  const int32_t* sizes, const int32_t* rows, int64_t topk, const GemmDims& d,
                  void* out);

}  // namespace jax_moe
