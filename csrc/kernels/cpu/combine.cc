// Step 7 on the CPU: the weighted combine back to token order.
#include "kernels/cpu/combine.h"

#include <algorithm>
#include <vector>

namespace jax_moe {
namespace {

// out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], f32 accumulation in j order.
template <DType DT>
void CombineRowsT(const void* y_raw, const float* w, const int32_t* s2d,
                  int64_t tokens, int64_t k, int64_t m, int64_t hidden,
                  void* out_raw) {
  using S = HostScalar<DT>;
  const auto* y = static_cast<const typename S::Storage*>(y_raw);
  auto* out = static_cast<typename S::Storage*>(out_raw);
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {
      int64_t r = s2d[t * k + j];
      if (r < 0 || r >= m) continue;  // not routed here: counts as zero
      float wt = w[t * k + j];
      const auto* row = y + r * hidden;
      for (int64_t h = 0; h < hidden; ++h) acc[h] += wt * S::Load(row[h]);
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = S::Store(acc[h]);
  }
}

}  // namespace

void CombineRows(DType dtype, const void* y, const float* w, const int32_t* src_to_dst,
                 int64_t tokens, int64_t k, int64_t m, int64_t hidden, void* out) {
  WithDType(dtype, [&]<DType DT>() {
    CombineRowsT<DT>(y, w, src_to_dst, tokens, k, m, hidden, out);
  });
}

}  // namespace jax_moe
