// The fp8 recipe (kernels/common/fp8_e4m3.h) on the GPU for the kernels
// that quantise rows of x themselves (fp8_skinny.cuh, fp8_sm90a.cuh): a
// half-warp holds one 128-channel block, 8 channels a lane. The hardware's
// conversions on sm_89+ (satfinite e4m3, exact e4m3 -> f16) give the
// recipe's codes for every input (tools/fp8_cvt_check.cu); the recipe's
// integer code runs elsewhere.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/common/fp8_e4m3.h"

namespace jax_moe {
namespace {

// The scale of the block held by this lane's half-warp, 8 values a lane:
// from the block's largest finite magnitude, NaN when any value is not
// finite. Every lane of the warp calls it (shuffles).
__device__ __forceinline__ float Fp8HalfWarpScale(const float (&v)[8]) {
  float amax = 0.f;
  bool bad = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!Fp8Finite(v[j])) bad = true;
    else amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) {  // within the half-warp
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    bad = __shfl_xor_sync(0xffffffffu, static_cast<int>(bad), off) != 0 || bad;
  }
  return Fp8BlockScale(amax, bad);
}

// The e4m3 codes of a and b (already divided by the block's scale), clipped
// to +-448, in the low and high byte.
__device__ __forceinline__ uint32_t Fp8Pair(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
#else
  return Fp8Quantize(a, 1.0f) | (static_cast<uint32_t>(Fp8Quantize(b, 1.0f)) << 8);
#endif
}

// The 8 codes of v at a block scale of 1 / inv, first value in the low byte.
__device__ __forceinline__ uint2 Fp8Codes8(const float (&v)[8], float inv) {
  uint2 codes;
  codes.x = Fp8Pair(v[0] * inv, v[1] * inv) | (Fp8Pair(v[2] * inv, v[3] * inv) << 16);
  codes.y = Fp8Pair(v[4] * inv, v[5] * inv) | (Fp8Pair(v[6] * inv, v[7] * inv) << 16);
  return codes;
}

// Two codes (the low 16 bits, low byte first) as an f16 pair's bits (exact).
__device__ __forceinline__ uint32_t Fp8DecodeHalf2(uint32_t codes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw raw =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(raw.x) | (static_cast<uint32_t>(raw.y) << 16);
#else
  const __half2 h = __floats2half2_rn(Fp8ToFloat(codes & 0xff), Fp8ToFloat((codes >> 8) & 0xff));
  uint32_t bits;
  memcpy(&bits, &h, 4);
  return bits;
#endif
}

}  // namespace
}  // namespace jax_moe
