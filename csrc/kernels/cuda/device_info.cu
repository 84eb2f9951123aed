// The hardware descriptor: what jax_moe.tuning.hardware() reports.
#include "kernels/cuda/device_info.h"

#include <cuda_runtime.h>

namespace jax_moe {

std::string QueryDevice(int ordinal, DeviceInfo* info) {
  cudaDeviceProp p{};
  const cudaError_t err = cudaGetDeviceProperties(&p, ordinal);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  int mem_clock_khz = 0, bus_bits = 0;
  // Not in cudaDeviceProp since CUDA 13: read as attributes.
  cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, ordinal);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, ordinal);
  info->name = p.name;
  info->major = p.major;
  info->minor = p.minor;
  info->sm_count = p.multiProcessorCount;
  info->smem_per_block_optin = static_cast<int64_t>(p.sharedMemPerBlockOptin);
  info->smem_per_sm = static_cast<int64_t>(p.sharedMemPerMultiprocessor);
  info->l2_bytes = p.l2CacheSize;
  info->global_mem_bytes = static_cast<int64_t>(p.totalGlobalMem);
  info->memory_bus_bits = bus_bits;
  info->memory_clock_khz = mem_clock_khz;
  return "";
}

}  // namespace jax_moe
