// Step 1 on the CPU: softmax over experts in f32, top-k, optional renormalize.
#include <cmath>
#include <vector>

#include "ffi_common.h"
#include "ops.h"

namespace jax_moe {
namespace {

template <ffi::DataType DT>
void TopkSoftmaxRows(const void* logits_raw, int64_t rows, int64_t experts,
                     int64_t k, bool renormalize, float* weights,
                     int32_t* ids) {
  using S = HostScalar<DT>;
  const auto* logits = static_cast<const typename S::Storage*>(logits_raw);
  std::vector<float> row(experts);
  std::vector<char> taken(experts);
  for (int64_t t = 0; t < rows; ++t) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) {
      row[e] = S::Load(logits[t * experts + e]);
      if (std::isnan(row[e])) row[e] = -INFINITY;  // NaN is never preferred
      mx = std::fmax(mx, row[e]);
    }
    float sum = 0.f;
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(row[e] - mx);
    std::fill(taken.begin(), taken.end(), 0);
    float picked_sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      // Select on the logits themselves (same order as the probabilities,
      // exact): ties go to the lower expert id.
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        if (taken[e]) continue;
        if (best < 0 || row[e] > row[best]) best = e;
      }
      taken[best] = 1;
      float p = std::exp(row[best] - mx) / sum;
      weights[t * k + j] = p;
      ids[t * k + j] = static_cast<int32_t>(best);
      picked_sum += p;
    }
    if (renormalize) {
      for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= picked_sum;
    }
  }
}

ffi::Error TopkSoftmaxCpu(ffi::AnyBuffer logits, bool renormalize,
                          ffi::Result<ffi::Buffer<ffi::F32>> weights,
                          ffi::Result<ffi::Buffer<ffi::S32>> ids) {
  const int64_t experts = LastDim(logits.dimensions());
  const int64_t rows = LeadingRows(logits.dimensions());
  const int64_t k = LastDim(weights->dimensions());
  if (k < 1 || k > experts) return InvalidArg("topk must be in [1, num_experts]");
  if (static_cast<int64_t>(weights->element_count()) != rows * k ||
      static_cast<int64_t>(ids->element_count()) != rows * k)
    return InvalidArg("topk_softmax: output shapes do not match (rows, topk)");
  return DispatchFloat(logits.element_type(), "router_logits", [&]<ffi::DataType DT>() {
    TopkSoftmaxRows<DT>(logits.untyped_data(), rows, experts, k, renormalize,
                        weights->typed_data(), ids->typed_data());
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTopkSoftmaxCpu, TopkSoftmaxCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("renormalize")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

}  // namespace jax_moe
