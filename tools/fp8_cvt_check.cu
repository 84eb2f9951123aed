// Checks, on the GPU, that the hardware's e4m3 conversion (cvt.rn.satfinite,
// which the Hopper fp8 GEMM's prep kernel uses) gives the recipe's code,
// Fp8Quantize(v, 1) (clip to +-448, then round to nearest even), for every
// one of the 2^32 floats; NaN inputs count as equal when both codes are NaN.
//
//   nvcc -std=c++17 -O2 -arch=sm_90a -Icsrc tools/fp8_cvt_check.cu -o /tmp/fp8_cvt_check
//   /tmp/fp8_cvt_check      # exit status 0: no mismatch
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>

#include "kernels/common/fp8_e4m3.h"

namespace {

constexpr int kMaxReported = 8;

__global__ void Check(unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float v = __uint_as_float(static_cast<uint32_t>(i));
    const uint8_t want = jax_moe::Fp8Quantize(v, 1.0f);
    const uint8_t got = static_cast<uint8_t>(
        __nv_cvt_float2_to_fp8x2(make_float2(v, v), __NV_SATFINITE, __NV_E4M3) & 0xff);
    const bool both_nan = (want & 0x7f) == 0x7f && (got & 0x7f) == 0x7f;
    if (want != got && !both_nan) {
      const unsigned long long at = atomicAdd(mismatches, 1ull);
      if (at < kMaxReported) first[at] = static_cast<uint32_t>(i);
    }
  }
}

}  // namespace

int main() {
  unsigned long long* mismatches = nullptr;
  uint32_t* first = nullptr;
  if (cudaMallocManaged(&mismatches, sizeof(*mismatches)) != cudaSuccess ||
      cudaMallocManaged(&first, kMaxReported * sizeof(*first)) != cudaSuccess) {
    std::printf("allocation failed\n");
    return 2;
  }
  *mismatches = 0;
  Check<<<2048, 256>>>(mismatches, first);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::printf("%llu mismatches over 2^32 floats\n", *mismatches);
  for (unsigned long long j = 0; j < *mismatches && j < kMaxReported; ++j)
    std::printf("  bits 0x%08x\n", first[j]);
  return *mismatches == 0 ? 0 : 1;
}
