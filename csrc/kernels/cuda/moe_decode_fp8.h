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

#ifdef JAX_MOE_DECODE_FP8_STAMPS
// The phase timestamps of the benchmark's build (benchmarks/kernels/
// moe_decode_fp8_bench.cu): block b of each later launch writes globaltimer
// at its points i = 0..kFp8StampPoints-1 to stamps[b * kFp8StampStride + i]
// (null: none).
constexpr int kFp8StampPoints = 9, kFp8StampStride = 16;
cudaError_t SetMoeDecodeFp8Stamps(unsigned long long* stamps);
#endif

}  // namespace jax_moe
