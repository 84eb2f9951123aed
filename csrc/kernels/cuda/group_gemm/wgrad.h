// The grouped GEMM's weight gradient on CUDA (wgrad.cu), the portable kernel
// for any sm_80+ GPU, for the group_gemm_wgrad handler
// (csrc/ffi/group_gemm_wgrad.cc): raw pointers, DType and cudaStream_t, no
// XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"

namespace jax_moe {

// dw[e] (d.n, d.k) = sum over the rows r of expert e of outer(dy[r], x_r) in
// `dtype` on `stream`, f32 accumulation in ascending row order (no atomics:
// the same bits every run). dy (d.m, d.n); x_r = x[r] (x (d.m, d.k)), or with
// `rows` (dst_to_src of a gather, d.m entries; x (d.x_rows, d.k))
// x[rows[r] / topk], a zero row where rows[r] is outside
// [0, d.x_rows * topk). Expert e owns rows [min(P_e, d.m), min(P_{e+1}, d.m)),
// P the prefix sum of max(sizes, 0), computed on the device; experts without
// rows get zeros. out: d.groups x d.n x d.k elements. Launches nothing when
// the output is empty; otherwise one kernel on `stream`: no sync, no
// allocation.
cudaError_t LaunchGroupGemmWgrad(cudaStream_t stream, DType dtype, const void* dy, const void* x,
                                 const int32_t* sizes, const int32_t* rows, int64_t topk,
                                 void* out, const GemmDims& d);

}  // namespace jax_moe
