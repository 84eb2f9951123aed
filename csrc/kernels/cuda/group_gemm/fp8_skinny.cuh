// The fp8 grouped GEMM's decode form (any CUDA GPU, sm_80+): a few rows an
// expert (m <= kFp8SkinnyMaxAvgRows * groups), where the time is reading the
// fp8 weights once. Same recipe and results (up to the order of the f32
// sums) as the portable kernel (fp8_simt.cuh) and the CPU one.
//
//  * Persistent: a resident grid; each block scans expert_sizes once into
//    shared memory (row starts and passes of up to 8 rows per expert) and
//    walks work items (expert, pass, 128 columns: one weight scale block),
//    the columns fastest so that blocks in flight share a pass's rows.
//  * Per item the pass's rows are quantised into shared memory
//    (fp8_quant.cuh's Fp8QuantiseRows).
//  * Tensor cores, swap-AB: eight warps of 16 weight rows (output columns)
//    each, mma.sync m16n8k16 with the weight rows on M and the pass's rows
//    (tokens) on N, both as f16 (which holds every e4m3 value exactly),
//    products summed in f32 over each 128-channel block, then added to the
//    accumulators times both block scales. A lane loads 16 codes (16 bytes)
//    of each of its two weight rows per 64 channels, straight into the mma's
//    A registers (Fp8LoadBlockCodes, Fp8MmaBlock). Two blocks' loads (eight
//    a lane) in flight.
//  * Rows past sum(sizes) are zeroed by the same grid after its items.
// Part of the one translation unit of dispatch.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "kernels/common/fp8_decode_rule.h"
#include "kernels/common/fp8_e4m3.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/expert_rows.cuh"
#include "kernels/cuda/group_gemm/fp8_quant.cuh"
#include "kernels/cuda/group_gemm/fp8_simt.cuh"

namespace jax_moe {
namespace {

constexpr int kFp8SkinnyThreads = 256;
constexpr int kFp8SkinnyRows = kFp8DecodeRows;  // token rows a pass: the mma's N
constexpr int kFp8SkinnyCols = 128;   // columns an item: 8 warps x 16, one scale block
// Up to 2 rows an expert on average (H200, the layer with DeepSeek-V3 and
// Qwen3-235B-A22B shapes: faster than the CUTLASS kernel at 0.5-1 rows an
// expert, slower at 4-8; docs/performance.md).
constexpr int kFp8SkinnyMaxAvgRows = 2;
static_assert(kFp8SkinnyCols == kFp8Block, "an item's columns share one weight scale block");

template <DType DT>
__global__ void __launch_bounds__(kFp8SkinnyThreads)
    GroupGemmFp8SkinnyKernel(const Fp8Storage<DT>* __restrict__ x,
                             const uint8_t* __restrict__ w, const float* __restrict__ w_scale,
                             const int32_t* __restrict__ sizes, const int32_t* __restrict__ rows,
                             int64_t topk, int64_t limit, Fp8Storage<DT>* __restrict__ out,
                             int64_t m, int64_t n, int64_t k, int64_t groups) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  const int64_t kp = kb * kFp8Block;  // a quantised row's pitch
  uint8_t* xq = smem;                                                          // [row][kp]
  float* sx = reinterpret_cast<float*>(xq + kFp8SkinnyRows * kp);             // [row][kb]
  int32_t* row_start = reinterpret_cast<int32_t*>(sx + kFp8SkinnyRows * kb);  // S[0..E]
  int32_t* pass0 = row_start + groups + 1;                                     // Q[0..E]

  // The schedule: S[e] = min(rows before e, m) (ForEachExpertRows),
  // Q[e] = passes before e (a second scan of each pass).
  using Scan = cub::BlockScan<int64_t, kFp8SkinnyThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t pass_carry = 0;
  const int64_t rows_total = ForEachExpertRows<kFp8SkinnyThreads>(
      sizes, groups, m, scan, [&](int64_t e, int64_t lo, int64_t hi) {
        const int64_t passes = e < groups ? (hi - lo + kFp8SkinnyRows - 1) / kFp8SkinnyRows : 0;
        int64_t pass_excl, pass_total;
        __syncthreads();  // `scan` is reused
        Scan(scan).ExclusiveSum(passes, pass_excl, pass_total);
        if (e < groups) {
          row_start[e] = static_cast<int32_t>(lo);
          pass0[e] = static_cast<int32_t>(pass_carry + pass_excl);
        }
        pass_carry += pass_total;
      });
  if (threadIdx.x == 0) {
    row_start[groups] = static_cast<int32_t>(rows_total);
    pass0[groups] = static_cast<int32_t>(pass_carry);
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;  // the mma's row group and k / token pair
  const int64_t chunks = (n + kFp8SkinnyCols - 1) / kFp8SkinnyCols;
  const int64_t items = static_cast<int64_t>(pass0[groups]) * chunks;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t chunk = item % chunks, pidx = item / chunks;
    int64_t lo = 0, hi = groups - 1;  // e: the last expert with Q[e] <= pidx (it has passes)
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (pass0[mid] <= pidx) lo = mid;
      else hi = mid - 1;
    }
    const int64_t e = lo;
    const int64_t r0 = row_start[e] + (pidx - pass0[e]) * kFp8SkinnyRows;
    const int64_t rows_left = row_start[e + 1] - r0;
    const int rn = static_cast<int>(rows_left < kFp8SkinnyRows ? rows_left : kFp8SkinnyRows);

    // The pass's rows, quantised. Rows past rn are left as they are: they
    // only reach the mma's columns of those rows, which are never stored.
    if (rows != nullptr) Fp8QuantiseRows<DT>(x, k, rn, xq, sx, kb, rows + r0, topk, limit);
    else Fp8QuantiseRows<DT>(x + r0 * k, k, rn, xq, sx, kb);

    // Warp: weight rows col0 + g and col0 + g + 8 on the mma's M side, the
    // pass's rows (tokens, row g of xq for lane (g, q)) on N.
    const int64_t col0 = chunk * kFp8SkinnyCols + warp * 16;
    const bool lo_ok = col0 + g < n, hi_ok = col0 + g + 8 < n;
    const uint8_t* w_lo = w + (e * n + col0 + g) * k + q * 16;
    const uint8_t* w_hi = w_lo + 8 * k;
    const float* ws = w_scale + (e * nb + chunk) * kb;
    const uint8_t* xrow = xq + g * kp + q * 16;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};  // (row g, tokens 2q, 2q+1), (row g+8, the same)
    for (int64_t b = 0; b < kb; b += 2) {  // two blocks: eight 16-byte loads in flight
      Fp8BlockCodes a[2];
#pragma unroll
      for (int bb = 0; bb < 2; ++bb)
        Fp8LoadBlockCodes(a[bb], w_lo, w_hi, b + bb, kb, k, lo_ok, hi_ok, q);
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        if (b + bb >= kb) break;
        float c4[4];
        Fp8MmaBlock(c4, a[bb], xrow + (b + bb) * kFp8Block);
        const float sw = __ldg(ws + b + bb);
        const float s0 = sx[(2 * q) * kb + b + bb] * sw, s1 = sx[(2 * q + 1) * kb + b + bb] * sw;
        acc[0] = fmaf(c4[0], s0, acc[0]);
        acc[1] = fmaf(c4[1], s1, acc[1]);
        acc[2] = fmaf(c4[2], s0, acc[2]);
        acc[3] = fmaf(c4[3], s1, acc[3]);
      }
    }
    using T = typename DevScalar<DT>::T;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 2 * q + (i & 1);
      const int64_t col = col0 + g + (i >> 1) * 8;
      if (tok < rn && col < n)
        reinterpret_cast<T*>(out)[(r0 + tok) * n + col] = DevScalar<DT>::Store(acc[i]);
    }
  }

  // Rows [S[E], m) are zero.
  const int64_t tail = (m - row_start[groups]) * n;
  using T = typename DevScalar<DT>::T;
  T* tail_out = reinterpret_cast<T*>(out) + static_cast<int64_t>(row_start[groups]) * n;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFp8SkinnyThreads + threadIdx.x; i < tail;
       i += static_cast<int64_t>(gridDim.x) * kFp8SkinnyThreads)
    tail_out[i] = DevScalar<DT>::Store(0.f);
}

}  // namespace
}  // namespace jax_moe
