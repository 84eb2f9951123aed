// The CPU grouped GEMMs' work split (group_gemm, group_gemm_fp8): items of one
// expert's rows times up to kGemmItemCols columns, run on the pool when the
// call is large enough.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/common/gemm_dims.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

// Columns of one expert per work item: their weight rows (converted to f32
// once per item, 32 x K floats) stay in cache while every row of the expert
// is multiplied by them.
constexpr int64_t kGemmItemCols = 32;
// Below this many multiply-adds a call runs on the calling thread alone.
constexpr int64_t kGemmParallelMacs = int64_t{1} << 22;

struct GemmItem {
  int64_t expert, row0, count, col0;  // expert, its first row and rows, first column
};

// The items of a grouped GEMM, rows owned as every backend owns them: expert
// e the next max(sizes[e], 0) rows, clamped to d.m (negative or oversized
// counts never index past the buffers). Returns the rows owned (the first
// row past the groups).
inline int64_t GemmItems(const int32_t* sizes, const GemmDims& d, std::vector<GemmItem>* items) {
  int64_t row = 0;
  for (int64_t e = 0; e < d.groups && row < d.m; ++e) {
    const int64_t count = std::min<int64_t>(std::max<int32_t>(sizes[e], 0), d.m - row);
    if (count == 0) continue;
    for (int64_t c0 = 0; c0 < d.n; c0 += kGemmItemCols) items->push_back({e, row, count, c0});
    row += count;
  }
  return row;
}

// run(i) for every item: on the pool when rows x n x k reaches
// kGemmParallelMacs, else on the calling thread. Each output is computed by
// one item, so the bits do not depend on the number of threads.
template <typename Run>
void RunGemmItems(const TaskPool& pool, const std::vector<GemmItem>& items, int64_t rows,
                  const GemmDims& d, Run&& run) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (rows * d.n * d.k < kGemmParallelMacs) {
    for (int64_t i = 0; i < n_items; ++i) run(i);
  } else {
    ParallelFor(pool, n_items, run);
  }
}

}  // namespace jax_moe
