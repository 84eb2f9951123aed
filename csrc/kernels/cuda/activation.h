// Step 5 on the GPU, the activation: its launcher (kernels/cuda/
// activation.cu), for the activation handler and for expert_mlp, which runs
// it between its two GEMMs.
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

}  // namespace jax_moe
