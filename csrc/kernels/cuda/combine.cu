// Step 7 on the GPU: the weighted combine back to token order, whole rows
// with 16-byte accesses whenever the row length allows.
#include "kernels/cuda/combine.h"

#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// Blocks (x: tokens, y: slices of the row; grid-stride both ways); each
// thread owns VEC consecutive columns and sums the k expert rows in slot
// order: a fixed order, so bitwise reproducible. The slots' indices and
// weights, then their rows, are loaded kBatch at a time before any is used:
// at decode a token is a handful of dependent loads, and they overlap.
template <DType DT, int VEC>
__global__ void CombineKernelT(const typename DevScalar<DT>::T* __restrict__ y,
                               const float* __restrict__ w, const int32_t* __restrict__ s2d,
                               int64_t tokens, int k, int64_t m, int64_t hidden,
                               typename DevScalar<DT>::T* __restrict__ out) {
  using S = DevScalar<DT>;
  using T = typename S::T;
  static_assert(sizeof(T) * VEC == 16 || VEC == 1, "16-byte vectors or scalars");
  constexpr int kBatch = 8;
  PdlWait();  // in moe_layer's call: y, w and s2d are this call's
  const int64_t h_step = static_cast<int64_t>(gridDim.y) * blockDim.x * VEC;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t h = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * VEC;
         h < hidden; h += h_step) {
      float acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
      for (int j0 = 0; j0 < k; j0 += kBatch) {
        int64_t r[kBatch];
        float wt[kBatch];
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          const int j = j0 + q;
          r[q] = j < k ? s2d[t * k + j] : -1;
          wt[q] = j < k ? w[t * k + j] : 0.f;
          if (r[q] >= m) r[q] = -1;  // not routed here: counts as zero
        }
        T vals[kBatch][VEC];
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          if (r[q] < 0) continue;
          if constexpr (VEC == 1) {
            vals[q][0] = y[r[q] * hidden + h];
          } else {
            *reinterpret_cast<uint4*>(vals[q]) =
                *reinterpret_cast<const uint4*>(y + r[q] * hidden + h);
          }
        }
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          if (r[q] < 0) continue;
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[v] += wt[q] * S::Load(vals[q][v]);
        }
      }
      T res[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) res[v] = S::Store(acc[v]);
      if constexpr (VEC == 1) {
        out[t * hidden + h] = res[0];
      } else {
        *reinterpret_cast<uint4*>(out + t * hidden + h) = *reinterpret_cast<uint4*>(res);
      }
    }
  }
}

}  // namespace

cudaError_t LaunchCombine(cudaStream_t stream, DType dtype, const void* y, const float* weights,
                          const int32_t* src_to_dst, int64_t tokens, int64_t k, int64_t m,
                          int64_t hidden, void* out, bool chained) {
  if (tokens == 0 || hidden == 0) return cudaSuccess;
  return WithDType(dtype, [&]<DType DT>() {
    using T = typename DevScalar<DT>::T;
    constexpr int kVec = 16 / sizeof(T);
    const auto* yp = static_cast<const T*>(y);
    auto* op = static_cast<T*>(out);
    const int vec = hidden % kVec == 0 ? kVec : 1;
    const int64_t units = hidden / vec;
    const int threads = vec == 1 ? 128 : (units >= 256 ? 256 : 64);
    // Few tokens (decode): a row is split over up to kSlices blocks so that
    // the launch is not a handful of blocks each walking a long row.
    constexpr int64_t kFewTokens = 512, kSlices = 8;
    const int64_t slices =
        tokens >= kFewTokens ? 1 : std::min<int64_t>(kSlices, CeilDiv(units, threads));
    const dim3 grid(GridFor(tokens, 1, 1u << 20), static_cast<unsigned>(slices));
    const bool pdl = chained && DeviceMajor() >= 9;
    return LaunchKernel(vec == kVec ? CombineKernelT<DT, kVec> : CombineKernelT<DT, 1>, grid,
                        threads, 0, stream, pdl, yp, weights, src_to_dst, tokens,
                        static_cast<int>(k), m, hidden, op);
  });
}

}  // namespace jax_moe
