// Step 3 on the CPU: expand (gather token rows into expert order).
#include "kernels/cpu/expand.h"

#include <cstring>

#include "kernels/common/numeric.h"

namespace jax_moe {

void ExpandRows(const void* x, int64_t tokens, int64_t row_bytes, const int32_t* d2s,
                int64_t m, int64_t topk, void* out) {
  const char* src = static_cast<const char*>(x);
  char* dst = static_cast<char*>(out);
  const int64_t limit = tokens * topk;
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = ExpandSourceRow(d2s[i], topk, limit);
    if (t >= 0) {
      std::memcpy(dst + i * row_bytes, src + t * row_bytes, row_bytes);
    } else {
      std::memset(dst + i * row_bytes, 0, row_bytes);
    }
  }
}

}  // namespace jax_moe
