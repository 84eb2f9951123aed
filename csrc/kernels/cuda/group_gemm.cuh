// The grouped GEMM's launcher, for handlers that run it inside another op's
// call (expert_mlp.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/ffi_common.h"
#include "ffi/shape_checks.h"

namespace jax_moe {

// Steps 4 / 6 (with `rows`, step 3 too) in `dtype` on `stream`, as the
// group_gemm handler runs them for tile_m 8 to 128 (256 is the handler's
// own sm90 path); d.m > 0 and d.n > 0. pdl: launched with programmatic
// stream serialisation (after another kernel of the call, whose output it
// may read: x; with wait_first, sizes and rows too).
cudaError_t LaunchGroupGemmFor(cudaStream_t stream, DType dtype, const void* x,
                               const void* w, const int32_t* sizes, void* out, const GemmDims& d,
                               const int32_t* rows, int64_t topk, int64_t tile_m, bool pdl,
                               bool wait_first = false);

}  // namespace jax_moe
