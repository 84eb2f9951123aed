// Shared helpers for the jax_moe FFI handlers (CPU and CUDA).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/common/numeric.h"
#include "kernels/cpu/parallel_for.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_MOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace jax_moe {

namespace ffi = xla::ffi;

// Product of all dimensions but the last: row-wise ops accept any leading
// batch dimensions (that is how vmap's broadcast_all reaches them).
template <typename Dims>
inline int64_t LeadingRows(const Dims& dims) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

template <typename Dims>
inline int64_t LastDim(const Dims& dims) {
  return dims.size() == 0 ? 1 : dims[dims.size() - 1];
}

inline ffi::Error InvalidArg(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_moe: " + msg);
}

inline bool IsFloatType(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 ||
         t == ffi::DataType::F16;
}

// The kernels' element type for a float buffer's (same values as XLA's).
inline DType ToDType(ffi::DataType t) { return static_cast<DType>(t); }
static_assert(static_cast<int>(ffi::DataType::F32) == static_cast<int>(DType::F32) &&
              static_cast<int>(ffi::DataType::BF16) == static_cast<int>(DType::BF16) &&
              static_cast<int>(ffi::DataType::F16) == static_cast<int>(DType::F16),
              "DType mirrors xla::ffi::DataType");

// Success for a float type (f32, bf16, f16), else the error naming `what`.
inline ffi::Error CheckFloat(ffi::DataType t, const char* what) {
  if (IsFloatType(t)) return ffi::Error::Success();
  return InvalidArg(std::string(what) + ": unsupported dtype (want f32, bf16 or f16)");
}

// Calls fn.template operator()<DT>() for the float type `t`.
template <typename Fn>
inline ffi::Error DispatchFloat(ffi::DataType t, const char* what, Fn&& fn) {
  switch (t) {
    case ffi::DataType::F32: return fn.template operator()<DType::F32>();
    case ffi::DataType::BF16: return fn.template operator()<DType::BF16>();
    case ffi::DataType::F16: return fn.template operator()<DType::F16>();
    default: return CheckFloat(t, what);
  }
}

// XLA's intra-op pool as the CPU kernels' TaskPool (valid while `pool` is).
inline TaskPool PoolOf(ffi::ThreadPool& pool) {
  return TaskPool{pool.num_threads(), &pool, [](void* impl, std::function<void()> task) {
                    static_cast<ffi::ThreadPool*>(impl)->Schedule(std::move(task));
                  }};
}

#ifdef JAX_MOE_WITH_CUDA
// A CUDA error as the handler's result: returned to XLA, never thrown or aborted.
inline ffi::Error CudaError(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_moe: ") + what + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}
inline ffi::Error LastCudaError(const char* what) { return CudaError(cudaGetLastError(), what); }
#endif

}  // namespace jax_moe
