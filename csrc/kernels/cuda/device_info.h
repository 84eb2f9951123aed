// The hardware descriptor that jax_moe.tuning.hardware() reports (host code,
// kernels/cuda/device_info.cu; the module's device_info()).
#pragma once

#include <cstdint>
#include <string>

namespace jax_moe {

struct DeviceInfo {
  std::string name;
  int major = 0, minor = 0, sm_count = 0;
  int64_t smem_per_block_optin = 0, smem_per_sm = 0, l2_bytes = 0, global_mem_bytes = 0;
  int memory_bus_bits = 0, memory_clock_khz = 0;
};

// Fills `info` for device `ordinal`; returns "" or the CUDA error's text.
std::string QueryDevice(int ordinal, DeviceInfo* info);

}  // namespace jax_moe
