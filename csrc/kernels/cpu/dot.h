// The CPU kernels' f32 dot product (group_gemm, group_gemm_fp8).
#pragma once

#include <cstdint>

namespace jax_moe {

// Eight independent partial sums so the compiler vectorises the dot product
// without reassociating (no -ffast-math needed); a fixed order for any n.
inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

}  // namespace jax_moe
