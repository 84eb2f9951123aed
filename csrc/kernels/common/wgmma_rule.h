// Where group_gemm's tile_m = 256 runs the own Hopper kernel
// (kernels/cuda/group_gemm/wgmma_sm90a.cu) instead of CUTLASS's, and where
// the forward-only layer fuses the w13 GEMM with the activation
// (group_gemm_act), by the call's shape alone: the rows rule and the
// kernel's shape limits. Plain C++: the CUDA handler
// and Python's choice (through the extension) read this one rule.
#pragma once

#include <cstdint>

#include "kernels/common/gemm_dims.h"

namespace jax_moe {

// Experts averaging at most this many rows: there the own kernel's 64-row
// edge tiles waste less than CUTLASS's 128-row ones and its fused gather
// and activation save a copy; with more rows an expert CUTLASS's kernel
// was the faster in the kernel benchmark
// (benchmarks/kernels/wgmma_gemm_bench.cu; docs/performance.md, Grouped GEMM).
constexpr int64_t kWgmmaMaxAvgRows = 128;

inline bool WgmmaPreferred(int64_t m, int64_t groups) {
  return groups > 0 && m > 0 && m <= kWgmmaMaxAvgRows * groups;
}

// The most experts the kernel schedules (its scan of expert_sizes lives in
// shared memory).
constexpr int64_t kWgmmaMaxExperts = 1024;

// Where the own kernel takes a problem of m rows and w (groups, n, k), by its
// shape alone: m and k within int32, n * groups within its int32 tensor-map
// coordinates, n and k multiples of 8 (16-byte rows for the TMA), at most
// kWgmmaMaxExperts experts, and with the gated activation (act) n a multiple
// of 16. The kernel also checks what needs the device or the call
// (compute capability 9.0, 16-byte aligned pointers, a gather with the act).
inline bool WgmmaShapeOk(int64_t m, int64_t n, int64_t k, int64_t groups, bool act) {
  return m > 0 && m <= kInt32Max && n > 0 && n % 8 == 0 && k > 0 && k <= kInt32Max &&
         k % 8 == 0 && groups > 0 && groups <= kWgmmaMaxExperts && n <= kInt32Max / groups &&
         (!act || n % 16 == 0);
}

}  // namespace jax_moe
