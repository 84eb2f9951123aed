// One token's routed experts with block-scaled fp8 weights in one kernel on
// the GPU (moe_decode_fp8): its launcher (kernels/cuda/moe_decode_fp8.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/moe_decode.h"
#include "kernels/common/numeric.h"

namespace jax_moe {

// Dynamic shared memory of a call: x's and the slots' act codes and scales.
int64_t MoeDecodeFp8Smem(int64_t hidden, int64_t inter, int64_t topk);

// p on the device, `dtype` (x's and out's) f32, bf16 or f16, within the
// kDecodeFp8* limits (kernels/common/moe_decode.h), 16-byte aligned: one
// cooperative launch of at most one resident grid. No host sync.
cudaError_t LaunchMoeDecodeFp8(cudaStream_t stream, DType dtype, const MoeDecodeFp8Problem& p);

}  // namespace jax_moe
