// The fp8 recipe (kernels/common/fp8_e4m3.h) on the GPU for the kernels
// that quantise rows of x themselves (fp8_skinny.cuh, fp8_sm90a.cuh,
// moe_decode_fp8.cu): a half-warp holds one 128-channel block, 8 channels a
// lane. The hardware's conversions on sm_89+ (satfinite e4m3, exact e4m3 ->
// f16) give the recipe's codes for every input (tools/fp8_cvt_check.cu); the
// recipe's integer code runs elsewhere. Also the decode kernels' shared
// steps: rows quantised into shared memory, and a warp's 16 weight rows
// multiplied with them on tensor cores.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/common/fp8_e4m3.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/cuda_common.cuh"

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

// x's storage in the fp8 kernels: f32, or the 16-bit bits of bf16 / f16.
template <DType DT>
using Fp8Storage = std::conditional_t<DT == DType::F32, float, uint16_t>;

// Tasks (8 channels) a thread of the one-token kernel loads before it
// quantises any: there the rows come from L2 (x in every block, an act row
// in the blocks whose w2 items use it), and a round of one load each, then
// the half-warp reductions, pays the load's latency once a round. The
// decode-form GEMM keeps one (slower with four: docs/performance.md).
constexpr int kFp8QuantBatch = 4;

// Rows [0, rows) of src (row pitch k elements, k % 8 == 0, 16-byte aligned)
// quantised by the whole block into xq (row pitch kp = kb * 128 bytes; codes
// past k are zero) and their block scales into sx (row pitch kb): a task is
// 8 channels, a half-warp a 128-channel block; a thread issues the loads of
// B tasks before it quantises them. With `gather` (dst_to_src entries of
// these rows), row i is instead src's row gather[i] / topk, a zero row
// outside [0, limit). Ends with the block at a barrier, xq and sx written.
template <DType DT, int B = 1>
__device__ void Fp8QuantiseRows(const Fp8Storage<DT>* __restrict__ src, int64_t k, int rows,
                                uint8_t* xq, float* sx, int64_t kb,
                                const int32_t* __restrict__ gather = nullptr, int64_t topk = 1,
                                int64_t limit = 0) {
  constexpr int kWords = DT == DType::F32 ? 2 : 1;  // 16-byte loads a task
  const int64_t kp = kb * kFp8Block, per_row = kp / 8;
  const int64_t tasks = rows * per_row;
  const int64_t step = blockDim.x;
  const int lane = threadIdx.x & 31;
  __syncthreads();  // earlier readers of xq / sx are done
  for (int64_t t0 = 0; t0 < tasks; t0 += B * step) {  // uniform: shuffles below
    int64_t from[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t t = t0 + b * step + threadIdx.x, row = t / per_row;
      from[b] = t >= tasks || (t % per_row) * 8 >= k ? -1
                : gather == nullptr                  ? row
                                                     : ExpandSourceRow(gather[row], topk, limit);
    }
    uint4 raw[B][kWords];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t c0 = ((t0 + b * step + threadIdx.x) % per_row) * 8;
#pragma unroll
      for (int w = 0; w < kWords; ++w)  // k % 8 == 0: all 8 channels in k
        raw[b][w] = from[b] < 0 ? make_uint4(0, 0, 0, 0)
                                : *reinterpret_cast<const uint4*>(src + from[b] * k + c0 +
                                                                  w * (8 / kWords));
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (t0 + b * step >= tasks) break;  // uniform
      const int64_t t = t0 + b * step + threadIdx.x;
      const int64_t row = t / per_row, c0 = (t % per_row) * 8;
      float v[8];
      if constexpr (DT == DType::F32) {
        memcpy(v, &raw[b][0], 16);
        memcpy(v + 4, &raw[b][1], 16);
      } else {
        Unpack<DT>(raw[b][0], v);
      }
      const float scale = Fp8HalfWarpScale(v);
      if (t < tasks) {
        *reinterpret_cast<uint2*>(xq + row * kp + c0) = Fp8Codes8(v, 1.0f / scale);
        if ((lane & 15) == 0) sx[row * kb + c0 / kFp8Block] = scale;
      }
    }
  }
  __syncthreads();
}

// A lane's codes of one 128-channel block of a warp's two weight rows (lo:
// row g, hi: row g + 8 of the mma's 16; g = lane / 4, q = lane % 4): per
// 64-channel half, channels [16 q, 16 q + 16), zero where a row is out of
// range or the block past k.
struct Fp8BlockCodes {
  uint4 v[2][2];  // [64-channel half][lo / hi]
};

// w_lo / w_hi: the rows' first codes plus 16 q; blk the block.
__device__ __forceinline__ void Fp8LoadBlockCodes(Fp8BlockCodes& a, const uint8_t* w_lo,
                                                  const uint8_t* w_hi, int64_t blk, int64_t kb,
                                                  int64_t k, bool lo_ok, bool hi_ok, int q) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t c = blk * kFp8Block + h * 64;
    const bool in_k = blk < kb && c + q * 16 < k;  // k % 16 == 0
    a.v[h][0] = in_k && lo_ok ? __ldg(reinterpret_cast<const uint4*>(w_lo + c))
                              : make_uint4(0, 0, 0, 0);
    a.v[h][1] = in_k && hi_ok ? __ldg(reinterpret_cast<const uint4*>(w_hi + c))
                              : make_uint4(0, 0, 0, 0);
  }
}

// The block's products, summed in f32 by mma.sync m16n8k16 (f16 operands,
// exact for e4m3): c4 (zeroed here) holds mma's C, rows g and g + 8 by the
// tokens 2q, 2q + 1. xblk: this lane's token row's codes of the block in
// shared memory, plus 16 q. Lane (g, q) gives the mma codes 4j + {0, 1} of
// each 16-code load as k slots 2q + {0, 1} and codes 4j + {2, 3} as slots
// 2q + 8 + {0, 1}: the reduction over the block's channels is permuted the
// same way in A and B.
__device__ __forceinline__ void Fp8MmaBlock(float (&c4)[4], const Fp8BlockCodes& a,
                                            const uint8_t* xblk) {
  c4[0] = c4[1] = c4[2] = c4[3] = 0.f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xblk + h * 64);
    const uint32_t xw[4] = {xv.x, xv.y, xv.z, xv.w};
    const uint4& lo = a.v[h][0];
    const uint4& hi = a.v[h][1];
    const uint32_t lw[4] = {lo.x, lo.y, lo.z, lo.w};
    const uint32_t hw[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t frag[4] = {Fp8DecodeHalf2(lw[j]), Fp8DecodeHalf2(hw[j]),
                                Fp8DecodeHalf2(lw[j] >> 16), Fp8DecodeHalf2(hw[j] >> 16)};
      Mma16816<__half>(c4, frag, Fp8DecodeHalf2(xw[j]), Fp8DecodeHalf2(xw[j] >> 16));
    }
  }
}

}  // namespace
}  // namespace jax_moe
