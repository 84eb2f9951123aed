// The grouped GEMM's launchers (csrc/kernels/cuda/group_gemm/), a plain C++
// header for the handlers (csrc/ffi/group_gemm.cc, expert_mlp.cc), the
// module and the kernel benchmarks: raw pointers, DType and cudaStream_t,
// no XLA include.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/group_gemm/gemm_sm90a.h"

namespace jax_moe {

// Steps 4 / 6 (with `rows`, step 3 too) in `dtype` on `stream`: out (d.m,
// d.n) = rows of x grouped by expert times w[e]^T, f32 accumulation, rows
// past sum(sizes) zero. rows: dst_to_src of a fused gather (row r of the input
// is x[rows[r] / topk], zero where rows[r] is outside [0, d.x_rows * topk)),
// or null. tile_m is 8, 16, 32, 64 or 128 (256, the sm90 path, is the
// group_gemm handler's own: GroupGemmSm90; here it runs as 128); d.m > 0 and
// d.n > 0. Launches only on `stream`: no sync, no allocation. pdl: launched
// with programmatic stream serialisation (after another kernel of the call,
// whose output it may read: x; with wait_first, sizes and rows too).
cudaError_t LaunchGroupGemmFor(cudaStream_t stream, DType dtype, const void* x,
                               const void* w, const int32_t* sizes, void* out, const GemmDims& d,
                               const int32_t* rows, int64_t topk, int64_t tile_m, bool pdl,
                               bool wait_first = false);

// The fp8 grouped GEMM (ops.group_gemm_fp8) in `dtype` (x's and out's) on
// `stream`: out (d.m, d.n) = rows of x, quantised per 128 channels, grouped
// by expert times the block-scaled e4m3 w[e]^T (w (d.groups, d.n, d.k) codes,
// w_scale (d.groups, ceil(d.n/128), ceil(d.k/128)) f32), as
// kernels/cpu/group_gemm_fp8.h; rows past sum(sizes) zero. With `rows`
// (dst_to_src of a gather, d.m entries), row r of x is x[rows[r] / topk], a
// zero row outside [0, d.x_rows * topk). d.m > 0, d.n > 0.
cudaError_t LaunchGroupGemmFp8For(cudaStream_t stream, DType dtype, const void* x,
                                  const uint8_t* w, const float* w_scale, const int32_t* sizes,
                                  const int32_t* rows, int64_t topk, void* out,
                                  const GemmDims& d);

// The fp8 grouped GEMM's decode form (fp8_skinny.cuh), the same call as
// LaunchGroupGemmFp8For, for at most 2 rows an expert on average (m <= 2 *
// groups), K a multiple of 16, 16-byte aligned x and w, and shared memory
// for the schedule and eight quantised rows (8 * (groups + 1) + 8 *
// ceil(K/128) * 132 bytes) within the device's opt-in limit and 160 KB.
// Sets *ran when it takes the call (and returns the launch's error);
// otherwise launches nothing and the caller runs another kernel.
// With `any_rows` it takes the call whatever the rows per expert (a
// caller's explicit choice of the decode form).
cudaError_t LaunchGroupGemmFp8Skinny(cudaStream_t stream, DType dtype, const void* x,
                                     const uint8_t* w, const float* w_scale,
                                     const int32_t* sizes, const int32_t* rows, int64_t topk,
                                     void* out, const GemmDims& d, bool any_rows, bool* ran);

// Whether the current device runs programmatic dependent launch (compute
// capability 9.0+), for a caller that chains LaunchGroupGemmFor with other
// kernels of one call (expert_mlp); asked once per device.
bool DeviceSupportsPdl();

}  // namespace jax_moe
