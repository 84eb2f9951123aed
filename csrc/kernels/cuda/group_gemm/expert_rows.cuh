// The rows of each expert, scanned by one block: expert e owns rows
// [min(P_e, m), min(P_{e+1}, m)), P the prefix sum of max(sizes[e], 0).
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

namespace jax_moe {
namespace {

// Runs over the experts kThreads a pass (thread t: expert base + t) and calls
// f(e, start, end) with expert e's rows [start, end); returns min(P_E, m).
// Contract: every thread of the block (blockDim.x == kThreads) calls it, and
// f is called on every thread of each pass, also for e >= groups (start ==
// end there), so f may run block-wide collectives of its own on `scan` after
// a __syncthreads(). Each pass ends with a __syncthreads() (`scan` is reused).
// The carry is clamped at m each pass, which is exact:
// min(min(a, m) + b, m) == min(a + b, m) for b >= 0.
template <int kThreads, typename F>
__device__ __forceinline__ int64_t ForEachExpertRows(
    const int32_t* __restrict__ sizes, int64_t groups, int64_t m,
    typename cub::BlockScan<int64_t, kThreads>::TempStorage& scan, F&& f) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  int64_t carry = 0;  // min(rows of the experts before this pass, m)
  for (int64_t base = 0; base < groups; base += kThreads) {
    const int64_t e = base + threadIdx.x;
    const int32_t s = e < groups ? sizes[e] : 0;
    const int64_t count = s > 0 ? s : 0;
    int64_t incl, pass_total;
    Scan(scan).InclusiveSum(count, incl, pass_total);
    const int64_t hi = carry + incl;
    const int64_t start = hi - count < m ? hi - count : m;
    const int64_t end = hi < m ? hi : m;
    f(e, start, end);
    carry = carry + pass_total < m ? carry + pass_total : m;
    __syncthreads();  // `scan` is reused by the next pass
  }
  return carry;
}

}  // namespace
}  // namespace jax_moe
