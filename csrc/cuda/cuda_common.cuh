// Device-side helpers shared by the CUDA handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "ffi_common.h"

namespace jax_moe {

// Device storage type of each FFI float type, and its f32 conversions.
template <ffi::DataType DT> struct DevScalar;
template <> struct DevScalar<ffi::DataType::F32> {
  using T = float;
  __device__ static float Load(float v) { return v; }
  __device__ static float Store(float v) { return v; }
};
template <> struct DevScalar<ffi::DataType::BF16> {
  using T = __nv_bfloat16;
  __device__ static float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 Store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct DevScalar<ffi::DataType::F16> {
  using T = __half;
  __device__ static float Load(__half v) { return __half2float(v); }
  __device__ static __half Store(float v) { return __float2half_rn(v); }
};

// Error after a launch: returned to XLA, never thrown or aborted.
inline ffi::Error LastCudaError(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_moe: ") + what + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

inline unsigned CeilDiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Grid size capped at a fixed number of blocks; kernels stride over the rest.
inline unsigned GridFor(int64_t items, int64_t per_block, unsigned cap = 65535u * 4) {
  int64_t g = (items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  return static_cast<unsigned>(g > cap ? cap : g);
}

}  // namespace jax_moe
