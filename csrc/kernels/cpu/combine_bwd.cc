// The backward of step 7 on the CPU: dy row by row, dw slot by slot.
#include "kernels/cpu/combine_bwd.h"

#include <algorithm>

namespace jax_moe {
namespace {

constexpr int64_t kRowsPerTask = 64;

template <DType DT>
void CombineBwdT(const TaskPool& pool, const void* g_raw, const void* y_raw, const float* w,
                 const int32_t* s2d, const int32_t* d2s, int64_t tokens, int64_t k, int64_t m,
                 int64_t hidden, void* dy_raw, float* dw) {
  using S = HostScalar<DT>;
  using St = typename S::Storage;
  const auto* g = static_cast<const St*>(g_raw);
  const auto* y = static_cast<const St*>(y_raw);
  auto* dy = static_cast<St*>(dy_raw);
  const int64_t slots = tokens * k;

  // dy: row r takes the slot that dst_to_src names, if that slot names r back.
  ParallelFor(pool, (m + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t c) {
    const int64_t end = std::min(m, (c + 1) * kRowsPerTask);
    for (int64_t r = c * kRowsPerTask; r < end; ++r) {
      St* out = dy + r * hidden;
      const int64_t i = d2s[r];
      if (i >= 0 && i < slots && s2d[i] == r) {
        const float wt = w[i];
        const St* src = g + (i / k) * hidden;
        for (int64_t h = 0; h < hidden; ++h) out[h] = S::Store(wt * S::Load(src[h]));
      } else {
        std::fill(out, out + hidden, S::Store(0.f));
      }
    }
  });

  // dw: one dot product per slot, h in order.
  ParallelFor(pool, (slots + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t c) {
    const int64_t end = std::min(slots, (c + 1) * kRowsPerTask);
    for (int64_t i = c * kRowsPerTask; i < end; ++i) {
      const int64_t r = s2d[i];
      float acc = 0.f;
      if (r >= 0 && r < m) {
        const St* yr = y + r * hidden;
        const St* gt = g + (i / k) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc += S::Load(yr[h]) * S::Load(gt[h]);
      }
      dw[i] = acc;
    }
  });
}

}  // namespace

void CombineBwdRows(const TaskPool& pool, DType dtype, const void* g, const void* y,
                    const float* w, const int32_t* src_to_dst, const int32_t* dst_to_src,
                    int64_t tokens, int64_t k, int64_t m, int64_t hidden, void* dy, float* dw) {
  WithDType(dtype, [&]<DType DT>() {
    CombineBwdT<DT>(pool, g, y, w, src_to_dst, dst_to_src, tokens, k, m, hidden, dy, dw);
  });
}

}  // namespace jax_moe
