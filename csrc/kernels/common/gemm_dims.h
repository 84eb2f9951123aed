// The grouped GEMM's problem shape, shared by the CPU kernel
// (kernels/cpu/group_gemm.h), the CUDA launchers (kernels/cuda/group_gemm/launch.h)
// and the handlers' checks that fill it (ffi/shape_checks.h); no XLA include.
#pragma once

#include <cstdint>

namespace jax_moe {

// out (m, n) = rows of x grouped by expert times w[e]^T, w (groups, n, k).
struct GemmDims {
  int64_t m, k, groups, n;
  int64_t x_rows;  // rows of x (== m without a gather)
};

// The largest int32: the Hopper kernels' bound on each of m, n, k and groups
// (CUTLASS's problem shapes and the tensor maps' coordinates are int32).
constexpr int64_t kInt32Max = 2147483647;

}  // namespace jax_moe
