// Steps 3 and 7 on the CPU: expand (gather rows by expert) and the weighted
// combine back to token order.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

// out[i] = x[dst_to_src[i] / topk]; rows with no valid source are zero.
ffi::Error ExpandCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> dst_to_src,
                     int64_t topk, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t tokens = LeadingRows(x.dimensions());
  const int64_t hidden = LastDim(x.dimensions());
  const int64_t m = dst_to_src.element_count();
  if (auto err = CheckExpand(x, dst_to_src, topk, *out); err.failure()) return err;
  const size_t row_bytes = hidden * ffi::ByteWidth(x.element_type());
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* d2s = dst_to_src.typed_data();
  const int64_t limit = tokens * topk;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = ExpandSourceRow(d2s[i], topk, limit);
    if (t >= 0) {
      std::memcpy(dst + i * row_bytes, src + t * row_bytes, row_bytes);
    } else {
      std::memset(dst + i * row_bytes, 0, row_bytes);
    }
  }
  return ffi::Error::Success();
}

// out[t] = sum_j w[t, j] * y[src_to_dst[t*k + j]], f32 accumulation in j order.
template <DType DT>
void CombineRows(const void* y_raw, const float* w, const int32_t* s2d,
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

ffi::Error CombineCpu(ffi::AnyBuffer y, ffi::Buffer<ffi::F32> weights,
                      ffi::Buffer<ffi::S32> src_to_dst,
                      ffi::Result<ffi::AnyBuffer> out) {
  CombineDims d;
  if (auto err = CheckCombine(y, weights, src_to_dst, *out, &d); err.failure()) return err;
  const int64_t m = d.m, hidden = d.hidden, k = d.k, tokens = d.tokens;
  return DispatchFloat(y.element_type(), "y", [&]<DType DT>() {
    CombineRows<DT>(y.untyped_data(), weights.typed_data(),
                    src_to_dst.typed_data(), tokens, k, m, hidden,
                    out->untyped_data());
    return ffi::Error::Success();
  });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kExpandCpu, ExpandCpu, ExpandSignature(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCombineCpu, CombineCpu, CombineSignature(ffi::Ffi::Bind()));

}  // namespace jax_moe
