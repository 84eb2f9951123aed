// The grouped GEMM's weight gradient, portable CUDA (sm_80+; the Hopper
// kernel is wgrad_sm90a.cu): dw[e] = dy_e^T @ x_e, the reduction over the
// expert's rows. One block per (64 x 64 tile of dw[e], expert e), 256 threads
// of 4 x 4 outputs in f32 registers; the expert's rows of dy and x (gathered
// through dst_to_src when given) are staged 32 at a time in shared memory as
// f32 and summed in ascending row order with one FMA per row: no split over
// rows, no atomics, the same bits every run.
#include "kernels/cuda/group_gemm/wgrad.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

constexpr int kTileN = 64;     // rows of dw[e] per tile (columns of dy)
constexpr int kTileK = 64;     // columns of dw[e] per tile (columns of x)
constexpr int kStep = 32;      // rows of dy and x staged per step
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
// The loader: thread t reads column t % 64 of rows t / 64 + 4 i, i < 8, of
// both operands (64 threads cover a 64-column row segment, coalesced).
constexpr int kRowStride = kThreads / kTileN;
constexpr int kLoads = kStep / kRowStride;
static_assert(kTileN == kTileK && kThreads % kTileN == 0 && kStep % kRowStride == 0 &&
                  kTileN == 16 * 4,
              "the loader and the 16 x 16 threads of 4 x 4 outputs assume these sizes");

// [*begin, *end): the rows of expert e, the prefix of max(sizes, 0) over the
// experts before it clamped to m, as every block computes it (integer sums:
// any order gives the same). All threads of the block call it.
__device__ void ExpertRows(const int32_t* __restrict__ sizes, int64_t e, int64_t m,
                           int64_t* begin, int64_t* end) {
  __shared__ long long warp_sums[kThreads / 32];
  long long s = 0;
  for (int64_t j = threadIdx.x; j < e; j += kThreads) s += max(sizes[j], 0);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = s;
  __syncthreads();
  long long before = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) before += warp_sums[w];
  __syncthreads();  // warp_sums is written again for the block's next expert
  const long long own = max(sizes[e], 0);
  *begin = min(before, static_cast<long long>(m));
  *end = min(before + own, static_cast<long long>(m));
}

// One row's contribution to this thread's 4 x 4 outputs: a (4 values of dy's
// row) times b (4 values of x's row), shared-memory float4 reads.
__device__ __forceinline__ void Fma4x4(float (&acc)[4][4], const float* a, const float* b) {
  const float4 av = *reinterpret_cast<const float4*>(a);
  const float4 bv = *reinterpret_cast<const float4*>(b);
  const float ar[4] = {av.x, av.y, av.z, av.w};
  const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
}

template <DType DT>
__global__ void __launch_bounds__(kThreads)
    GroupGemmWgradKernel(const typename DevScalar<DT>::T* __restrict__ dy,
                         const typename DevScalar<DT>::T* __restrict__ x,
                         const int32_t* __restrict__ sizes, const int32_t* __restrict__ rows,
                         int64_t topk, typename DevScalar<DT>::T* __restrict__ out, GemmDims d) {
  using S = DevScalar<DT>;
  __shared__ __align__(16) float sdy[kStep][kTileN];
  __shared__ __align__(16) float sx[kStep][kTileK];
  const int tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16;                   // outputs (ty*4.., tx*4..)
  const int lc = tid % kTileN, lr = tid / kTileN;           // loader: column, first row
  const int64_t n = d.n, k = d.k;
  const int64_t tiles_k = (k + kTileK - 1) / kTileK;
  const int64_t tiles = (n + kTileN - 1) / kTileN * tiles_k;
  const int64_t limit = d.x_rows * topk;  // valid dst_to_src entries: [0, limit)

  for (int64_t e = blockIdx.y; e < d.groups; e += gridDim.y) {
    int64_t begin, end;
    ExpertRows(sizes, e, d.m, &begin, &end);  // block-uniform: the loops below are too
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const int64_t n0 = t / tiles_k * kTileN, k0 = t % tiles_k * kTileK;
      const int64_t ln = n0 + lc, lk = k0 + lc;  // the loader's columns of dy and x
      // Rows r0 + lr + 4 i into registers as f32; zero past the expert's
      // rows, past N or K, and for a gathered row outside the tokens.
      float rdy[kLoads], rx[kLoads];
      auto gload = [&](int64_t r0) {
#pragma unroll
        for (int i = 0; i < kLoads; ++i) {
          const int64_t r = r0 + lr + i * kRowStride;
          const bool in = r < end;  // r >= begin >= 0 and end <= d.m
          int64_t src = -1;
          if (in) src = rows != nullptr ? ExpandSourceRow(rows[r], topk, limit) : r;
          rdy[i] = in && ln < n ? S::Load(dy[r * n + ln]) : 0.f;
          rx[i] = src >= 0 && lk < k ? S::Load(x[src * k + lk]) : 0.f;
        }
      };
      float acc[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

      if (begin < end) gload(begin);
      for (int64_t r0 = begin; r0 < end; r0 += kStep) {
        __syncthreads();  // the previous step (or tile) is done reading sdy and sx
#pragma unroll
        for (int i = 0; i < kLoads; ++i) {
          sdy[lr + i * kRowStride][lc] = rdy[i];
          sx[lr + i * kRowStride][lc] = rx[i];
        }
        __syncthreads();
        if (r0 + kStep < end) gload(r0 + kStep);  // in flight during the FMAs below
        // Exactly the expert's rows, in order (zero rows past its end would
        // only turn a -0 sum into +0, but they are not added either).
        const int64_t count = min(static_cast<int64_t>(kStep), end - r0);
        if (count == kStep) {
#pragma unroll 8
          for (int j = 0; j < kStep; ++j) Fma4x4(acc, &sdy[j][ty * 4], &sx[j][tx * 4]);
        } else {
          for (int j = 0; j < count; ++j) Fma4x4(acc, &sdy[j][ty * 4], &sx[j][tx * 4]);
        }
      }

      // An expert without rows stores the zeros it started with.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t on = n0 + ty * 4 + i;
        if (on >= n) continue;
        auto* dst = out + (e * n + on) * k;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t ok = k0 + tx * 4 + j;
          if (ok < k) dst[ok] = S::Store(acc[i][j]);
        }
      }
    }
  }
}

template <DType DT>
cudaError_t Launch(cudaStream_t stream, const void* dy, const void* x, const int32_t* sizes,
                   const int32_t* rows, int64_t topk, void* out, const GemmDims& d) {
  using T = typename DevScalar<DT>::T;
  const int64_t tiles = static_cast<int64_t>(CeilDiv(d.n, kTileN)) * CeilDiv(d.k, kTileK);
  // Both grid dimensions are capped; the kernel strides over the rest.
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles, int64_t{1} << 30)),
                  static_cast<unsigned>(std::min<int64_t>(d.groups, 65535)));
  return LaunchKernel(GroupGemmWgradKernel<DT>, grid, dim3(kThreads), 0, stream, false,
                      static_cast<const T*>(dy), static_cast<const T*>(x), sizes, rows, topk,
                      static_cast<T*>(out), d);
}

}  // namespace

cudaError_t LaunchGroupGemmWgrad(cudaStream_t stream, DType dtype, const void* dy, const void* x,
                                 const int32_t* sizes, const int32_t* rows, int64_t topk,
                                 void* out, const GemmDims& d) {
  if (d.groups <= 0 || d.n <= 0 || d.k <= 0) return cudaSuccess;  // an empty output
  return WithDType(dtype, [&]<DType DT>() {
    return Launch<DT>(stream, dy, x, sizes, rows, topk, out, d);
  });
}

}  // namespace jax_moe
