// Step 5 on the GPU, the activation: its launcher (kernels/cuda/
// activation.cu), for the activation handler and for expert_mlp, which runs
// it between its two GEMMs; and its backward's, for the activation_grad
// handler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/numeric.h"

namespace jax_moe {

// act(in[r, :inter]) * in[r, inter:] (gated; in is rows x 2 inter) or
// act(in) into out (rows x inter), in `dtype` (f32, bf16 or f16), on
// `stream`; `activation` is an Activation code. pdl: launched with
// programmatic stream serialisation (after another kernel of the call).
cudaError_t LaunchActivation(cudaStream_t stream, DType dtype, int64_t activation,
                             bool gated, const void* in, int64_t rows, int64_t inter, void* out,
                             bool pdl);

// The backward for the cotangent d (rows x inter): out (in's shape) = d *
// in[r, inter:] * act'(in[r, :inter]) and d * act(in[r, :inter]) (gated) or
// d * act'(in), computed in f32, in `dtype`, on `stream`.
cudaError_t LaunchActivationGrad(cudaStream_t stream, DType dtype, int64_t activation, bool gated,
                                 const void* in, const void* d, int64_t rows, int64_t inter,
                                 void* out);

// The routed layer's backward, for the cotangent scale[r] * d[r] (d: rows x
// inter; scale: rows f32): dh (in's shape) as LaunchActivationGrad's, as
// (rows x inter) = scale[r] * act(in[r]) (gated: times up) and dot[r] (f32) =
// the sum over c of that activation, rounded to `dtype` as the forward stores
// it, times d[r, c]; computed in f32, on `stream`. dh may be `in` (in place).
cudaError_t LaunchActivationScaledGrad(cudaStream_t stream, DType dtype, int64_t activation,
                                       bool gated, const void* in, const void* d,
                                       const float* scale, int64_t rows, int64_t inter, void* dh,
                                       void* as, float* dot);

}  // namespace jax_moe
