// Handler symbols defined in csrc/cpu/*.cc and csrc/cuda/*.cu, registered by module.cc.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_moe {

#define JAX_MOE_DECLARE(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(name)

JAX_MOE_DECLARE(kTopkSoftmaxCpu);
JAX_MOE_DECLARE(kTokenIndexCpu);
JAX_MOE_DECLARE(kExpandCpu);
JAX_MOE_DECLARE(kCombineCpu);
JAX_MOE_DECLARE(kGroupGemmCpu);
JAX_MOE_DECLARE(kGatedActCpu);
JAX_MOE_DECLARE(kWriteKvCpu);
JAX_MOE_DECLARE(kPagedDecodeCpu);

#ifdef JAX_MOE_WITH_CUDA
JAX_MOE_DECLARE(kTopkSoftmaxCuda);
JAX_MOE_DECLARE(kTokenIndexCuda);
JAX_MOE_DECLARE(kExpandCuda);
JAX_MOE_DECLARE(kCombineCuda);
JAX_MOE_DECLARE(kGroupGemmCuda);
JAX_MOE_DECLARE(kGatedActCuda);
JAX_MOE_DECLARE(kWriteKvCuda);
JAX_MOE_DECLARE(kPagedDecodeCuda);
#endif

#undef JAX_MOE_DECLARE

#ifdef JAX_MOE_WITH_CUDA
// The hardware descriptor (csrc/cuda/device_info.cu).
struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0, sm_count = 0;
  int64_t smem_per_block_optin = 0, smem_per_sm = 0, l2_bytes = 0, global_mem_bytes = 0;
  int memory_bus_bits = 0, memory_clock_khz = 0;
};
// Fills `info` for device `ordinal`; returns "" or the CUDA error's text.
std::string QueryDevice(int ordinal, DeviceInfo* info);
#endif

}  // namespace jax_moe
