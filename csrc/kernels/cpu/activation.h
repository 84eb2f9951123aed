// Step 5 on the CPU, the activation and its backward (kernels/cpu/activation.cc).
#pragma once

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// out (rows x inter) = act(in[r, :inter]) * in[r, inter:] (gated) or
// act(in[r, :]) for the rows of in (width wide), in `dtype`, computed in f32;
// `activation` is an Activation code.
void ActivationRows(DType dtype, const void* in, int64_t rows, int64_t width, int64_t inter,
                    int64_t activation, bool gated, void* out);

// The backward for the output cotangent d (rows x inter): out (rows x width,
// in's shape) = d * in[r, inter:] * act'(in[r, :inter]) and d *
// act(in[r, :inter]) (gated) or d * act'(in), in `dtype`, computed in f32.
void ActivationGradRows(DType dtype, const void* in, const void* d, int64_t rows, int64_t width,
                        int64_t inter, int64_t activation, bool gated, void* out);

// The routed layer's activation backward (act_math.h's ActScaledGradRows):
// for the cotangent scale[r] * d[r], dh (in's shape), as = scale[r] * act
// (rows x inter) and dot[r] = <act[r], d[r]> (f32), in `dtype`.
void ActivationScaledGradRows(DType dtype, const void* in, const void* d, const float* scale,
                              int64_t rows, int64_t width, int64_t inter, int64_t activation,
                              bool gated, void* dh, void* as, float* dot);

}  // namespace jax_moe
