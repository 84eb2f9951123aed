// The activation functions of step 5 on the CPU, shared by the activation
// kernel (kernels/cpu/activation.cc) and expert_mlp (kernels/cpu/
// group_gemm.cc): one definition, so both give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

inline float ActHost(float g, int64_t act) {
  switch (act) {
    case kGeluExact: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case kGeluTanh: {
      float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.f + std::tanh(inner));
    }
    default: return g / (1.f + std::exp(-g));
  }
}

// act(in[r, :inter]) * in[r, inter:] (gated) or act(in[r, :]) for `rows` rows
// of width `width`, computed in f32, into out (rows x inter).
template <typename S>
void ActRows(const typename S::Storage* in, int64_t rows, int64_t width, int64_t inter,
             int64_t act, bool gated, typename S::Storage* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inter; ++c) {
      float a = ActHost(S::Load(in[r * width + c]), act);
      if (gated) a *= S::Load(in[r * width + inter + c]);
      out[r * inter + c] = S::Store(a);
    }
}

}  // namespace jax_moe
