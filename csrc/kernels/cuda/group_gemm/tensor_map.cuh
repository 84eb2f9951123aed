// cuTensorMapEncodeTiled, the driver's tensor-map encoder, reached through
// the runtime (no link against libcuda): shared by the TMA kernels
// (tma_decode.cuh, wgmma_sm90a.cu). Host only.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

namespace jax_moe {
namespace {

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no
// link against libcuda); null when the driver does not have it.
using TensorMapEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                       const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                       const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion,
                                       CUtensorMapFloatOOBfill);
inline TensorMapEncodeFn TensorMapEncode() {
  static const TensorMapEncodeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<TensorMapEncodeFn>(nullptr);
    }
    return reinterpret_cast<TensorMapEncodeFn>(p);
  }();
  return fn;
}

}  // namespace
}  // namespace jax_moe
