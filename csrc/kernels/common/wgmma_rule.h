// Where group_gemm's tile_m = 256 runs the own Hopper kernel
// (kernels/cuda/group_gemm/wgmma_sm90a.cu) instead of CUTLASS's, and where
// the forward-only layer fuses the w13 GEMM with the activation
// (group_gemm_act), by the call's shape alone. Plain C++: the CUDA handler
// and Python's choice (through the extension) read this one rule.
#pragma once

#include <cstdint>

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

}  // namespace jax_moe
