// The fp8 grouped GEMM, portable form (any CUDA GPU): block-scaled e4m3
// weights, x's rows quantised per 128 channels inside the kernel (no
// quantised copy of x in memory), SIMT f32 FMA. 64x64 tiles; per 128-channel
// block the block's rows are quantised into shared memory (four threads a
// row, the amax by shuffles), the weights' codes decoded next to them (both
// as f16, which holds every e4m3 value exactly), the block's products summed
// in f32 and added to the accumulators times both scales. The arithmetic is
// kernels/common/fp8_e4m3.h's, as the CPU kernel and the reference twin.
// Part of the one translation unit of dispatch.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/fp8_e4m3.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/fp8_quant.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"

namespace jax_moe {
namespace {

constexpr int kF8BM = 64;  // rows per tile
constexpr int kF8BN = 64;  // columns per tile: inside one 128-column scale block
constexpr int kF8Ld = kF8BM + 8;  // f16 row pitch of the [channel][row] stages
static_assert(kFp8Block % kF8BN == 0, "a tile's columns share one weight scale block");
static_assert(kF8BM == kF8BN, "one loader layout for both operands");

template <DType DT>
__device__ __forceinline__ float Fp8LoadX(const Fp8Storage<DT>* p) {
  using T = typename DevScalar<DT>::T;
  return DevScalar<DT>::Load(*reinterpret_cast<const T*>(p));
}

template <DType DT>
__device__ void GemmTileFp8(const Fp8Storage<DT>* __restrict__ x, const uint8_t* __restrict__ w,
                            const float* __restrict__ w_scale, Fp8Storage<DT>* __restrict__ out,
                            const Tile& tile, const RowSource& src, int64_t n0, int64_t n,
                            int64_t k, bool vec_w) {
  __shared__ __align__(16) __half sa[kFp8Block][kF8Ld];  // x's values, [channel][row]
  __shared__ __align__(16) __half sb[kFp8Block][kF8Ld];  // w's values, [channel][column]
  __shared__ float s_sx[kF8BM];                          // x's scale of each row
  const int tid = threadIdx.x;
  const int lr = tid >> 2, lq = (tid & 3) * 32;  // loader: row / column, first channel
  const int ty = tid >> 4, tx = tid & 15;         // compute: 16 x 16 threads, 4 x 4 each
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block;
  const int64_t nb = (n + kFp8Block - 1) / kFp8Block;
  const int64_t xr = tile.row0 + lr < tile.row_lim ? src.Row(tile.row0 + lr) : -1;
  const Fp8Storage<DT>* xrow = xr >= 0 ? x + xr * k : nullptr;
  const uint8_t* wrow = n0 + lr < n ? w + (tile.expert * n + n0 + lr) * k : nullptr;
  const float* ws = w_scale + (tile.expert * nb + n0 / kFp8Block) * kb;

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  for (int64_t b = 0; b < kb; ++b) {
    const int64_t c0 = b * kFp8Block + lq;  // this thread's first channel
    // x: 32 channels of one row; the row's scale from its four threads' amax.
    float v[32];
    float amax = 0.f;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      v[j] = xrow != nullptr && c0 + j < k ? Fp8LoadX<DT>(xrow + c0 + j) : 0.f;
      if (!Fp8Finite(v[j])) bad = true;
      else amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      bad = __shfl_xor_sync(0xffffffffu, static_cast<int>(bad), off) != 0 || bad;
    }
    const float scale = Fp8BlockScale(amax, bad);
    const float inv = 1.0f / scale;
    __syncthreads();  // the previous block's (or tile's) FMAs are done with sa / sb
#pragma unroll
    for (int j = 0; j < 32; ++j) sa[lq + j][lr] = __float2half_rn(Fp8ToFloat(Fp8Quantize(v[j], inv)));
    if ((tid & 3) == 0) s_sx[lr] = scale;
    // w: 32 channels of one column's codes.
    uint8_t code[32];
    if (wrow != nullptr && vec_w && c0 + 32 <= k) {
      const uint4 q0 = __ldg(reinterpret_cast<const uint4*>(wrow + c0));
      const uint4 q1 = __ldg(reinterpret_cast<const uint4*>(wrow + c0 + 16));
      memcpy(code, &q0, 16);
      memcpy(code + 16, &q1, 16);
    } else {
#pragma unroll
      for (int j = 0; j < 32; ++j) code[j] = wrow != nullptr && c0 + j < k ? wrow[c0 + j] : 0;
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) sb[lq + j][lr] = __float2half_rn(Fp8ToFloat(code[j]));
    __syncthreads();

    float part[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) part[i][j] = 0.f;
#pragma unroll 4
    for (int c = 0; c < kFp8Block; ++c) {
      const float2 a01 = __half22float2(*reinterpret_cast<const __half2*>(&sa[c][ty * 4]));
      const float2 a23 = __half22float2(*reinterpret_cast<const __half2*>(&sa[c][ty * 4 + 2]));
      const float2 b01 = __half22float2(*reinterpret_cast<const __half2*>(&sb[c][tx * 4]));
      const float2 b23 = __half22float2(*reinterpret_cast<const __half2*>(&sb[c][tx * 4 + 2]));
      const float a[4] = {a01.x, a01.y, a23.x, a23.y};
      const float bv[4] = {b01.x, b01.y, b23.x, b23.y};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = fmaf(a[i], bv[j], part[i][j]);
    }
    const float sw = ws[b];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sx = s_sx[ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j] * sx * sw;
    }
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = tile.row0 + ty * 4 + i;
    if (r >= tile.row_lim) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t c = n0 + tx * 4 + j;
      if (c < n) {
        using T = typename DevScalar<DT>::T;
        reinterpret_cast<T*>(out)[r * n + c] = DevScalar<DT>::Store(acc[i][j]);
      }
    }
  }
}

template <DType DT>
__global__ void __launch_bounds__(kThreads)
    GroupGemmFp8Kernel(const Fp8Storage<DT>* __restrict__ x, const uint8_t* __restrict__ w,
                       const float* __restrict__ w_scale, const int32_t* __restrict__ sizes,
                       Fp8Storage<DT>* __restrict__ out, GemmArgs a) {
  ForEachTile<kF8BM, kF8BN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    GemmTileFp8<DT>(x, w, w_scale, out, tile, a.src, n0, a.n, a.k, a.vec_in);
  });
}

}  // namespace
}  // namespace jax_moe
