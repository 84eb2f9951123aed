// The routed layer for one token in one kernel on the GPU (ops.moe_decode):
// its launcher (kernels/cuda/moe_decode.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/moe_decode.h"
#include "kernels/common/numeric.h"

namespace jax_moe {

// p on the device, `dtype` (x's) bf16 or f16, within the kDecode* limits
// (kernels/common/moe_decode.h): one cooperative launch, one block per SM.
cudaError_t LaunchMoeDecode(cudaStream_t stream, DType dtype, const MoeDecodeProblem& p);

#ifdef JAX_MOE_DECODE_STAMPS
// Only where moe_decode.cu is compiled with JAX_MOE_DECODE_STAMPS (the kernel
// benchmark's own copy, benchmarks/kernels/CMakeLists.txt; never the
// shipped library): the buffer, or nullptr for none, that the next launches
// write their phase timestamps to. Block b writes globaltimer at point i to
// stamps[b * 8 + i]: 0 start, 1 routed, 2 w13 done, 3 past the grid barrier,
// 4 w2 rows in, 5 dots done, 6 end (4 and 5 at every pass; a block without
// output columns stops after 3).
cudaError_t SetMoeDecodeStamps(unsigned long long* stamps);
#endif

}  // namespace jax_moe
