// Step 2 on the CPU: histogram, exclusive prefix sum, stable placement.
//
// Entries whose expert id lies outside [start_expert, start_expert +
// num_local) (another rank's experts, or an invalid id) are not placed: their
// src_to_dst is -1, and dst_to_src holds -1 past the last placed row.
#include <vector>

#include "ffi/ffi_common.h"
#include "ffi/layer_steps.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {

ffi::Error TokenIndexCpu(ffi::Buffer<ffi::S32> topk_ids, int64_t num_experts,
                         int64_t start_expert,
                         ffi::Result<ffi::Buffer<ffi::S32>> src_to_dst,
                         ffi::Result<ffi::Buffer<ffi::S32>> dst_to_src,
                         ffi::Result<ffi::Buffer<ffi::S32>> expert_sizes,
                         ffi::Result<ffi::Buffer<ffi::S32>> /*scratch*/) {
  if (auto err = CheckTokenIndex(topk_ids, num_experts, start_expert, *src_to_dst, *dst_to_src,
                                 *expert_sizes);
      err.failure())
    return err;
  const int64_t n = topk_ids.element_count();
  const int64_t local = expert_sizes->element_count();
  const int32_t* ids = topk_ids.typed_data();
  int32_t* s2d = src_to_dst->typed_data();
  int32_t* d2s = dst_to_src->typed_data();
  int32_t* sizes = expert_sizes->typed_data();

  std::vector<int64_t> offset(local, 0);
  for (int64_t e = 0; e < local; ++e) sizes[e] = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t e = static_cast<int64_t>(ids[i]) - start_expert;
    if (e >= 0 && e < local) ++sizes[e];
  }
  int64_t total = 0;
  for (int64_t e = 0; e < local; ++e) {
    offset[e] = total;
    total += sizes[e];
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t e = static_cast<int64_t>(ids[i]) - start_expert;
    if (e >= 0 && e < local) {
      int64_t pos = offset[e]++;
      s2d[i] = static_cast<int32_t>(pos);
      d2s[pos] = static_cast<int32_t>(i);
    } else {
      s2d[i] = -1;
    }
  }
  for (int64_t p = total; p < n; ++p) d2s[p] = -1;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTokenIndexCpu, TokenIndexCpu, TokenIndexSignature(ffi::Ffi::Bind()));

}  // namespace jax_moe
