// Step 2 on the CPU: histogram, exclusive prefix sum, stable placement.
//
// Entries whose expert id lies outside [start_expert, start_expert +
// num_local) (another rank's experts, or an invalid id) are not placed: their
// src_to_dst is -1, and dst_to_src holds -1 past the last placed row.
#include "kernels/cpu/token_index.h"

#include <vector>

namespace jax_moe {

void ComputeTokenIndex(const int32_t* ids, int64_t n, int64_t start_expert, int64_t local,
                       int32_t* s2d, int32_t* d2s, int32_t* sizes) {
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
}

}  // namespace jax_moe
