// The backward of step 7 on the GPU. Memory-bound: one pass by token reads
// g[t] once and the rows y[r] its slots name once, writes dy[r] for the rows
// that those slots own (dst_to_src names the slot back) and dw[t, :]; a
// second pass writes zeros to the rows no slot owns. The two passes write
// disjoint rows, so each row of dy is written exactly once.
#include "kernels/cuda/combine_bwd.h"

#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

constexpr int kSlotBatch = 8;   // slots of one token in flight at once
constexpr int kMaxThreads = 128;

// Blocks (x: tokens, y: batches of kSlotBatch slots; grid-stride both ways).
// Each thread owns VEC consecutive columns, strided by the block: it loads
// g's columns once per batch and the batch's rows of y together, keeps one
// partial dot product per slot and writes the owned rows of dy. The
// partials are then summed by a fixed tree (warp shuffles, then the warps in
// order): bitwise reproducible for a given launch shape, which depends only
// on H and the dtype.
template <DType DT, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    CombineBwdTokenKernel(const typename DevScalar<DT>::T* __restrict__ g,
                          const typename DevScalar<DT>::T* __restrict__ y,
                          const float* __restrict__ w, const int32_t* __restrict__ s2d,
                          const int32_t* __restrict__ d2s, int64_t tokens, int k, int64_t m,
                          int64_t hidden, typename DevScalar<DT>::T* __restrict__ dy,
                          float* __restrict__ dw) {
  using S = DevScalar<DT>;
  using T = typename S::T;
  static_assert(sizeof(T) * VEC == 16 || VEC == 1, "16-byte vectors or scalars");
  __shared__ float partial[kMaxThreads / 32][kSlotBatch];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;  // blockDim.x: a multiple of 32, <= kMaxThreads
  const int64_t h_step = static_cast<int64_t>(blockDim.x) * VEC;
  // t and j0 depend on the block only: every thread reaches each barrier.
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* gt = g + t * hidden;
    for (int j0 = blockIdx.y * kSlotBatch; j0 < k; j0 += gridDim.y * kSlotBatch) {
      // The batch's rows (-1: none, or out of range), weights and ownership.
      int32_t r[kSlotBatch];
      float wt[kSlotBatch];
      bool own[kSlotBatch];
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q) {
        const int64_t i = t * k + j0 + q;
        r[q] = -1;
        wt[q] = 0.f;
        own[q] = false;
        if (j0 + q < k) {
          const int32_t row = s2d[i];
          if (row >= 0 && row < m) {
            r[q] = row;
            wt[q] = w[i];
            own[q] = d2s[row] == i;
          }
        }
      }
      float acc[kSlotBatch];
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q) acc[q] = 0.f;
      for (int64_t h = static_cast<int64_t>(threadIdx.x) * VEC; h < hidden; h += h_step) {
        T gv[VEC];
        T vals[kSlotBatch][VEC];
        if constexpr (VEC == 1) {
          gv[0] = gt[h];
        } else {
          *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(gt + h);
        }
#pragma unroll
        for (int q = 0; q < kSlotBatch; ++q) {
          if (r[q] < 0) continue;
          const T* src = y + static_cast<int64_t>(r[q]) * hidden + h;
          if constexpr (VEC == 1) {
            vals[q][0] = *src;
          } else {
            *reinterpret_cast<uint4*>(vals[q]) = *reinterpret_cast<const uint4*>(src);
          }
        }
        float gf[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) gf[v] = S::Load(gv[v]);
#pragma unroll
        for (int q = 0; q < kSlotBatch; ++q) {
          if (r[q] < 0) continue;
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[q] = fmaf(S::Load(vals[q][v]), gf[v], acc[q]);
        }
#pragma unroll
        for (int q = 0; q < kSlotBatch; ++q) {
          if (!own[q]) continue;
          T res[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) res[v] = S::Store(wt[q] * gf[v]);
          T* dst = dy + static_cast<int64_t>(r[q]) * hidden + h;
          if constexpr (VEC == 1) {
            *dst = res[0];
          } else {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(res);
          }
        }
      }
      // dw: each warp's partials to lane 0, then warp 0..warps-1 in order.
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q) {
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) acc[q] += __shfl_down_sync(0xffffffffu, acc[q], d);
      }
      if (lane == 0) {
#pragma unroll
        for (int q = 0; q < kSlotBatch; ++q) partial[warp][q] = acc[q];
      }
      __syncthreads();
      if (threadIdx.x < kSlotBatch && j0 + static_cast<int>(threadIdx.x) < k) {
        float sum = 0.f;
        for (int p = 0; p < warps; ++p) sum += partial[p][threadIdx.x];
        dw[t * k + j0 + threadIdx.x] = sum;
      }
      __syncthreads();  // partial is rewritten by the next batch
    }
  }
}

// Zeros the rows of dy that no slot owns: each warp checks 32 rows at once
// (row r is owned when i = d2s[r] is a slot and s2d[i] == r, exactly the rows
// the token kernel writes) and then zeros the unowned ones, a row at a time
// with coalesced stores.
template <typename Unit>
__global__ void CombineBwdZeroRowsKernel(const int32_t* __restrict__ s2d,
                                         const int32_t* __restrict__ d2s, int64_t slots,
                                         int64_t m, int64_t units_per_row,
                                         Unit* __restrict__ dy) {
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warp_count = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  // base is the same for the 32 lanes of a warp: the ballot sees all of them.
  for (int64_t base = first_warp * 32; base < m; base += warp_count * 32) {
    const int64_t r = base + lane;
    bool zero = false;
    if (r < m) {
      const int64_t i = d2s[r];
      zero = !(i >= 0 && i < slots && s2d[i] == r);
    }
    for (unsigned mask = __ballot_sync(0xffffffffu, zero); mask != 0; mask &= mask - 1) {
      Unit* row = dy + (base + __ffs(mask) - 1) * units_per_row;
      for (int64_t u = lane; u < units_per_row; u += 32) row[u] = Unit{};
    }
  }
}

template <typename Unit>
cudaError_t LaunchZeroRows(cudaStream_t stream, const int32_t* s2d, const int32_t* d2s,
                           int64_t slots, int64_t m, int64_t row_bytes, void* dy) {
  constexpr int kThreads = 256;
  CombineBwdZeroRowsKernel<Unit><<<GridFor(m, kThreads, 1u << 20), kThreads, 0, stream>>>(
      s2d, d2s, slots, m, row_bytes / static_cast<int64_t>(sizeof(Unit)), static_cast<Unit*>(dy));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCombineBwd(cudaStream_t stream, DType dtype, const void* g, const void* y,
                             const float* w, const int32_t* src_to_dst,
                             const int32_t* dst_to_src, int64_t tokens, int64_t k, int64_t m,
                             int64_t hidden, void* dy, float* dw) {
  return WithDType(dtype, [&]<DType DT>() -> cudaError_t {
    using T = typename DevScalar<DT>::T;
    if (tokens > 0 && k > 0) {
      constexpr int kVec = 16 / sizeof(T);
      const int vec = hidden % kVec == 0 ? kVec : 1;
      const int64_t units = hidden / vec;
      const int threads = units >= 128 ? 128 : (units >= 64 ? 64 : 32);
      const dim3 grid(GridFor(tokens, 1, 1u << 20),
                      static_cast<unsigned>(std::min<int64_t>(CeilDiv(k, kSlotBatch), 65535)));
      const auto* gp = static_cast<const T*>(g);
      const auto* yp = static_cast<const T*>(y);
      auto* dyp = static_cast<T*>(dy);
      if (vec == kVec) {
        CombineBwdTokenKernel<DT, kVec><<<grid, threads, 0, stream>>>(
            gp, yp, w, src_to_dst, dst_to_src, tokens, static_cast<int>(k), m, hidden, dyp, dw);
      } else {
        CombineBwdTokenKernel<DT, 1><<<grid, threads, 0, stream>>>(
            gp, yp, w, src_to_dst, dst_to_src, tokens, static_cast<int>(k), m, hidden, dyp, dw);
      }
      if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    }
    if (m == 0 || hidden == 0) return cudaSuccess;
    const int64_t row_bytes = hidden * static_cast<int64_t>(sizeof(T));
    const int64_t slots = tokens * k;
    if (row_bytes % 16 == 0)
      return LaunchZeroRows<uint4>(stream, src_to_dst, dst_to_src, slots, m, row_bytes, dy);
    if (row_bytes % 4 == 0)
      return LaunchZeroRows<uint32_t>(stream, src_to_dst, dst_to_src, slots, m, row_bytes, dy);
    return LaunchZeroRows<uint16_t>(stream, src_to_dst, dst_to_src, slots, m, row_bytes, dy);
  });
}

}  // namespace jax_moe
