// Steps 4 and 6 on the CPU: out[rows of group e] = x[rows of e] @ w[e]^T,
// f32 accumulation. Rows past sum(expert_sizes) are zero. With a gather, row r
// of the input is x[rows[r] / topk] (zero when out of range), as in step 3.
#include "kernels/cpu/group_gemm.h"

#include <algorithm>
#include <vector>

#include "kernels/common/numeric.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/gemm_items.h"
#include "kernels/cpu/parallel_for.h"

namespace jax_moe {

template <DType DT>
void GroupGemm(const TaskPool& pool, const void* x_raw, const void* w_raw, const int32_t* sizes,
               const GemmDims& d, const int32_t* rows, int64_t topk, void* out_raw) {
  const int64_t m = d.m, n = d.n, k = d.k;
  using S = HostScalar<DT>;
  const auto* x = static_cast<const typename S::Storage*>(x_raw);
  const auto* w = static_cast<const typename S::Storage*>(w_raw);
  auto* out = static_cast<typename S::Storage*>(out_raw);
  std::vector<GemmItem> items;
  const int64_t row = GemmItems(sizes, d, &items);
  // Each output is one Dot over all of K, whichever thread computes it: the
  // same bits for any number of threads.
  auto run = [&](int64_t i) {
    const GemmItem& it = items[i];
    const int64_t cols = std::min(kGemmItemCols, n - it.col0);
    thread_local std::vector<float> wf, xf;  // reused across items and calls
    wf.resize(cols * k);
    xf.resize(k);
    const auto* wsrc = w + (it.expert * n + it.col0) * k;
    for (int64_t j = 0; j < cols * k; ++j) wf[j] = S::Load(wsrc[j]);
    for (int64_t r = it.row0; r < it.row0 + it.count; ++r) {
      const int64_t src = rows != nullptr ? ExpandSourceRow(rows[r], topk, d.x_rows * topk) : r;
      for (int64_t c = 0; c < k; ++c) xf[c] = src >= 0 ? S::Load(x[src * k + c]) : 0.f;
      for (int64_t c = 0; c < cols; ++c)
        out[r * n + it.col0 + c] = S::Store(Dot(xf.data(), wf.data() + c * k, k));
    }
  };
  RunGemmItems(pool, items, row, d, run);
  std::fill(out + row * n, out + m * n, S::Store(0.f));
}

template void GroupGemm<DType::F32>(const TaskPool&, const void*, const void*, const int32_t*,
                                    const GemmDims&, const int32_t*, int64_t, void*);
template void GroupGemm<DType::BF16>(const TaskPool&, const void*, const void*, const int32_t*,
                                     const GemmDims&, const int32_t*, int64_t, void*);
template void GroupGemm<DType::F16>(const TaskPool&, const void*, const void*, const int32_t*,
                                    const GemmDims&, const int32_t*, int64_t, void*);

}  // namespace jax_moe
