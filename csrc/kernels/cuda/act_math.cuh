// The activation functions of step 5 on the GPU, in f32: the forms of
// kernels/cpu/act_math.h. Shared by the activation kernels (activation.cu)
// and the fused fp8 decode kernel (moe_decode_fp8.cu), so both give the same
// bits.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/numeric.h"

namespace jax_moe {
namespace {

template <int ACT>
__device__ __forceinline__ float Act(float g) {
  if constexpr (ACT == kGeluExact) {
    return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
  } else if constexpr (ACT == kGeluTanh) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  } else {
    return g / (1.f + expf(-g));
  }
}

// act(g) and act'(g) (into slope), in f32: the forms of kernels/cpu/act_math.h.
template <int ACT>
__device__ __forceinline__ float ActSlope(float g, float* slope) {
  if constexpr (ACT == kGeluExact) {
    const float cdf = 0.5f * (1.f + erff(g * 0.70710678118654752f));
    *slope = cdf + g * 0.3989422804014327f * expf(-0.5f * g * g);
    return g * cdf;
  } else if constexpr (ACT == kGeluTanh) {
    const float c = 0.7978845608028654f;
    const float t = tanhf(c * (g + 0.044715f * g * g * g));
    *slope = 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * c * (1.f + 3.f * 0.044715f * g * g);
    return 0.5f * g * (1.f + t);
  } else {
    const float s = 1.f / (1.f + expf(-g));
    *slope = s * (1.f + g * (1.f - s));
    return g * s;
  }
}

}  // namespace
}  // namespace jax_moe
