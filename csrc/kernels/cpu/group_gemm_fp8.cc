// The fp8 grouped GEMM on the CPU: x's rows quantised per 128 channels,
// e4m3 x e4m3 products summed per 128-channel block in f32, each block's sum
// scaled by both operands' scales (kernels/common/fp8_e4m3.h).
#include "kernels/cpu/group_gemm_fp8.h"

#include <algorithm>
#include <vector>

#include "kernels/common/fp8_e4m3.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/dot.h"
#include "kernels/cpu/gemm_items.h"

namespace jax_moe {
namespace {

// Row x (k values, already f32) -> its e4m3 values decoded to f32 (exact) and
// one scale per 128-channel block.
void QuantizeRow(const float* x, int64_t k, float* values, float* scales) {
  for (int64_t b0 = 0, b = 0; b0 < k; b0 += kFp8Block, ++b) {
    const int64_t end = std::min(k, b0 + kFp8Block);
    float amax = 0.f;
    bool bad = false;
    for (int64_t i = b0; i < end; ++i) {
      if (!Fp8Finite(x[i])) bad = true;
      else amax = std::max(amax, std::abs(x[i]));
    }
    const float scale = Fp8BlockScale(amax, bad);
    const float inv = 1.0f / scale;
    scales[b] = scale;
    for (int64_t i = b0; i < end; ++i) values[i] = Fp8ToFloat(Fp8Quantize(x[i], inv));
  }
}

}  // namespace

template <DType DT>
void GroupGemmFp8(const TaskPool& pool, const void* x_raw, const uint8_t* w, const float* w_scale,
                  const int32_t* sizes, const int32_t* rows, int64_t topk, const GemmDims& d,
                  void* out_raw) {
  const int64_t m = d.m, n = d.n, k = d.k;
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  using S = HostScalar<DT>;
  const auto* x = static_cast<const typename S::Storage*>(x_raw);
  auto* out = static_cast<typename S::Storage*>(out_raw);
  std::vector<GemmItem> items;
  const int64_t row = GemmItems(sizes, d, &items);
  auto run = [&](int64_t i) {
    const GemmItem& it = items[i];
    const int64_t cols = std::min(kGemmItemCols, n - it.col0);
    thread_local std::vector<float> wf, xf, xq, sx;
    wf.resize(cols * k);
    xf.resize(k);
    xq.resize(k);
    sx.resize(kb);
    const uint8_t* wsrc = w + (it.expert * n + it.col0) * k;
    for (int64_t j = 0; j < cols * k; ++j) wf[j] = Fp8ToFloat(wsrc[j]);
    const float* ws = w_scale + it.expert * nb * kb;
    for (int64_t r = it.row0; r < it.row0 + it.count; ++r) {
      const int64_t from = rows == nullptr ? r : ExpandSourceRow(rows[r], topk, d.x_rows * topk);
      for (int64_t c = 0; c < k; ++c) xf[c] = from >= 0 ? S::Load(x[from * k + c]) : 0.f;
      QuantizeRow(xf.data(), k, xq.data(), sx.data());
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t col = it.col0 + c;
        float acc = 0.f;
        for (int64_t b = 0; b < kb; ++b) {
          const int64_t b0 = b * kFp8Block, len = std::min<int64_t>(kFp8Block, k - b0);
          const float part = Dot(xq.data() + b0, wf.data() + c * k + b0, len);
          acc += part * sx[b] * ws[(col / kFp8Block) * kb + b];
        }
        out[r * n + col] = S::Store(acc);
      }
    }
  };
  RunGemmItems(pool, items, row, d, run);
  std::fill(out + row * n, out + m * n, S::Store(0.f));
}

template void GroupGemmFp8<DType::F32>(const TaskPool&, const void*, const uint8_t*,
                                       const float*, const int32_t*, const int32_t*, int64_t,
                                       const GemmDims&, void*);
template void GroupGemmFp8<DType::BF16>(const TaskPool&, const void*, const uint8_t*,
                                        const float*, const int32_t*, const int32_t*, int64_t,
                                        const GemmDims&, void*);
template void GroupGemmFp8<DType::F16>(const TaskPool&, const void*, const uint8_t*,
                                       const float*, const int32_t*, const int32_t*, int64_t,
                                       const GemmDims&, void*);

}  // namespace jax_moe
