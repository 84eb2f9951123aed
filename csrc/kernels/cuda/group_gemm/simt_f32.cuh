// The grouped GEMM in f32: exact-f32 SIMT FMA (no TF32), 128x128x8 tiles,
// 8x8 outputs per thread, operands transposed into shared memory, register
// prefetch of the next k tile. Part of the one translation unit of
// dispatch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"

namespace jax_moe {
namespace {

// ---------------------------------------------------------------------------
// f32: exact SIMT FMA
// ---------------------------------------------------------------------------

constexpr int kBMf = 128;  // rows per tile
constexpr int kBKf = 8;
// Operands are stored k-major ([k][row]); +4 keeps float4 alignment and makes
// the transposing stores conflict-free (bank = 4*k + row).
constexpr int kLdf = kBMf + 4;

// Four consecutive k of one row into registers. `src` points at the row's
// element for this chunk, or is null for a row out of range; `rem` counts the
// elements left in the row from there. float4 only when all four are in
// bounds and aligned, else element-wise with zero fill.
__device__ __forceinline__ void LoadF4(float (&v)[4], const float* src, int64_t rem, bool vec) {
  if (src != nullptr && rem > 0) {
    if (vec && rem >= 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(src));
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = j < rem ? src[j] : 0.f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 0.f;
  }
}

__device__ void GemmTileF32(const float* __restrict__ x, const float* __restrict__ w,
                            float* __restrict__ out, const Tile& tile, const RowSource& src,
                            int64_t n0, int64_t n, int64_t k, bool vec_in, bool vec_out) {
  __shared__ __align__(16) float sa[2][kBKf][kLdf];
  __shared__ __align__(16) float sb[2][kBKf][kLdf];
  const int64_t row0 = tile.row0, row_lim = tile.row_lim;
  const int tid = threadIdx.x;
  const int lr = tid >> 1, lk = (tid & 1) * 4;  // loader: row, first k
  const int ty = tid >> 4, tx = tid & 15;       // compute: 16 x 16 threads
  const int64_t ktiles = CeilDiv(k, kBKf);
  // Row pointers are fixed for the whole K loop; null marks a row out of range.
  const int64_t xr = row0 + lr < row_lim ? src.Row(row0 + lr) : -1;
  const float* a_src = xr >= 0 ? x + xr * k + lk : nullptr;
  const float* b_src = n0 + lr < n ? w + (tile.expert * n + n0 + lr) * k + lk : nullptr;

  float ra[4], rb[4];
  auto gload = [&](int64_t k0) {
    const int64_t rem = k - k0 - lk;
    LoadF4(ra, a_src ? a_src + k0 : nullptr, rem, vec_in);
    LoadF4(rb, b_src ? b_src + k0 : nullptr, rem, vec_in);
  };
  auto sstore = [&](int buf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sa[buf][lk + j][lr] = ra[j];
      sb[buf][lk + j][lr] = rb[j];
    }
  };

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  __syncthreads();  // the previous grid-stride tile may still read sa/sb
  if (ktiles > 0) {
    gload(0);
    sstore(0);
  }
  __syncthreads();
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    const int buf = static_cast<int>(kt & 1);
    const bool more = kt + 1 < ktiles;
    if (more) gload((kt + 1) * kBKf);  // in flight during the FMAs below
#pragma unroll
    for (int kk = 0; kk < kBKf; ++kk) {
      // Rows ty*4.. and 64+ty*4.., columns tx*4.. and 64+tx*4..: float4 reads
      // that are broadcast (A) or contiguous (B) across the warp.
      const float4 a0 = *reinterpret_cast<const float4*>(&sa[buf][kk][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&sa[buf][kk][64 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&sb[buf][kk][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&sb[buf][kk][64 + tx * 4]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (more) sstore(buf ^ 1);  // that buffer was last read before the barrier below
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t grow = row0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
    if (grow >= row_lim) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t gcol = n0 + h * 64 + tx * 4;
      if (gcol >= n) continue;
      float* dst = out + grow * n + gcol;
      if (vec_out && gcol + 4 <= n) {
        *reinterpret_cast<float4*>(dst) =
            make_float4(acc[i][h * 4], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (gcol + q < n) dst[q] = acc[i][h * 4 + q];
      }
    }
  }
}

// Two blocks per SM (<= 128 registers).
__global__ void __launch_bounds__(kThreads, 2)
    GroupGemmF32Kernel(const float* __restrict__ x, const float* __restrict__ w,
                       const int32_t* __restrict__ sizes, float* __restrict__ out, GemmArgs a) {
  PdlStart(a);
  ForEachTile<kBMf, kBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    PdlWait();  // x may be the previous kernel's output
    GemmTileF32(x, w, out, tile, a.src, n0, a.n, a.k, a.vec_in, a.vec_out);
  });
  PdlWait();  // a block without tiles too: this grid ends after its primary
}

}  // namespace
}  // namespace jax_moe
