// The grouped GEMM's weight gradient on the CPU: dw[e] = dy_e^T @ x_e, the
// reduction running over each expert's rows, f32 accumulation in row order.
#include "kernels/cpu/group_gemm_wgrad.h"

#include <algorithm>
#include <vector>

#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {
namespace {

// A work item is one expert's block of kItemN x kItemK outputs: its f32
// accumulators (32 KB) stay in L1 while the expert's rows stream through,
// one contiguous row of kItemK products per output row.
constexpr int64_t kItemN = 16;
constexpr int64_t kItemK = 512;
// Below this many multiply-adds the call runs on the calling thread alone.
constexpr int64_t kParallelMacs = int64_t{1} << 22;

// acc[c] += a * x[c]: independent lanes, so the compiler vectorises it
// without reassociating any sum.
inline void Axpy(float* __restrict__ acc, float a, const float* __restrict__ x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += a * x[c];
}

}  // namespace

template <DType DT>
void GroupGemmWgrad(const TaskPool& pool, const void* dy_raw, const void* x_raw,
                    const int32_t* sizes, const GemmDims& d, const int32_t* rows, int64_t topk,
                    void* out_raw) {
  const int64_t m = d.m, n = d.n, k = d.k, groups = d.groups;
  if (groups <= 0 || n <= 0 || k <= 0) return;  // no output
  using S = HostScalar<DT>;
  const auto* dy = static_cast<const typename S::Storage*>(dy_raw);
  const auto* x = static_cast<const typename S::Storage*>(x_raw);
  auto* out = static_cast<typename S::Storage*>(out_raw);
  // Each expert's rows [begin, end), clamped: negative counts are 0 and no
  // group reaches past m.
  std::vector<int64_t> begin(groups), end(groups);
  int64_t row = 0;
  for (int64_t e = 0; e < groups; ++e) {
    begin[e] = row;
    row += std::min<int64_t>(std::max<int32_t>(sizes[e], 0), m - row);
    end[e] = row;
  }
  const int64_t blocks_n = (n + kItemN - 1) / kItemN, blocks_k = (k + kItemK - 1) / kItemK;
  const int64_t per_expert = blocks_n * blocks_k;
  const int64_t limit = d.x_rows * topk;
  // Every output is owned by one item and sums the expert's rows in
  // ascending order: the same bits for any number of threads. An expert
  // without rows stores the zeros its accumulators start with.
  auto run = [&](int64_t i) {
    const int64_t e = i / per_expert, blk = i % per_expert;
    const int64_t n0 = blk / blocks_k * kItemN, k0 = blk % blocks_k * kItemK;
    const int64_t nc = std::min(kItemN, n - n0), kc = std::min(kItemK, k - k0);
    thread_local std::vector<float> acc, xf;  // reused across items and calls
    acc.assign(nc * kc, 0.f);
    xf.resize(kc);
    for (int64_t r = begin[e]; r < end[e]; ++r) {
      // A gathered row outside the tokens is a zero row (multiplied like any
      // other, so an inf or NaN in dy propagates as the formula says).
      const int64_t src = rows != nullptr ? ExpandSourceRow(rows[r], topk, limit) : r;
      for (int64_t c = 0; c < kc; ++c) xf[c] = src >= 0 ? S::Load(x[src * k + k0 + c]) : 0.f;
      const auto* dy_row = dy + r * n + n0;
      for (int64_t j = 0; j < nc; ++j) Axpy(acc.data() + j * kc, S::Load(dy_row[j]), xf.data(), kc);
    }
    auto* dst = out + (e * n + n0) * k + k0;
    for (int64_t j = 0; j < nc; ++j)
      for (int64_t c = 0; c < kc; ++c) dst[j * k + c] = S::Store(acc[j * kc + c]);
  };
  const int64_t n_items = groups * per_expert;
  if (row * n * k < kParallelMacs) {
    for (int64_t i = 0; i < n_items; ++i) run(i);
  } else {
    ParallelFor(pool, n_items, run);
  }
}

template void GroupGemmWgrad<DType::F32>(const TaskPool&, const void*, const void*,
                                         const int32_t*, const GemmDims&, const int32_t*, int64_t,
                                         void*);
template void GroupGemmWgrad<DType::BF16>(const TaskPool&, const void*, const void*,
                                          const int32_t*, const GemmDims&, const int32_t*,
                                          int64_t, void*);
template void GroupGemmWgrad<DType::F16>(const TaskPool&, const void*, const void*,
                                         const int32_t*, const GemmDims&, const int32_t*, int64_t,
                                         void*);

}  // namespace jax_moe
