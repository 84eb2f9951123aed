// Steps 3 and 7 on the GPU: expand (gather token rows into expert order) and
// the weighted combine back to token order. Both move whole rows, with 16-byte
// accesses whenever the row length allows.
#include <algorithm>

#include "kernels/cuda/cuda_common.cuh"
#include "ffi/layer_steps.h"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"

namespace jax_moe {
namespace {

// One block per output row (grid-stride); `Unit` is the copy granule.
template <typename Unit>
__global__ void ExpandKernel(const Unit* __restrict__ x, const int32_t* __restrict__ dst_to_src,
                             int64_t m, int64_t units_per_row, int64_t limit, int64_t topk,
                             Unit* __restrict__ out) {
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    const int64_t s = dst_to_src[i];
    Unit* dst = out + i * units_per_row;
    if (s >= 0 && s < limit) {
      const Unit* src = x + (s / topk) * units_per_row;
      for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) dst[u] = src[u];
    } else {
      for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) dst[u] = Unit{};
    }
  }
}

template <typename Unit>
ffi::Error LaunchExpand(cudaStream_t stream, const void* x, const int32_t* d2s, int64_t m,
                        int64_t row_bytes, int64_t limit, int64_t topk, void* out) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  ExpandKernel<Unit><<<GridFor(m, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(x), d2s, m, units, limit, topk, static_cast<Unit*>(out));
  return LastCudaError("moe_expand_input launch");
}

ffi::Error ExpandCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> dst_to_src,
                      int64_t topk, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t tokens = LeadingRows(x.dimensions());
  const int64_t hidden = LastDim(x.dimensions());
  const int64_t m = dst_to_src.element_count();
  if (auto err = CheckExpand(x, dst_to_src, topk, *out); err.failure()) return err;
  if (m == 0 || hidden == 0) return ffi::Error::Success();
  const int64_t row_bytes = hidden * ffi::ByteWidth(x.element_type());
  const int64_t limit = tokens * topk;
  if (row_bytes % 16 == 0)
    return LaunchExpand<uint4>(stream, x.untyped_data(), dst_to_src.typed_data(), m, row_bytes,
                               limit, topk, out->untyped_data());
  if (row_bytes % 4 == 0)
    return LaunchExpand<uint32_t>(stream, x.untyped_data(), dst_to_src.typed_data(), m,
                                  row_bytes, limit, topk, out->untyped_data());
  return LaunchExpand<uint16_t>(stream, x.untyped_data(), dst_to_src.typed_data(), m, row_bytes,
                                limit, topk, out->untyped_data());
}

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

ffi::Error CombineSteps(cudaStream_t stream, ffi::AnyBuffer y, F32In weights, S32In src_to_dst,
                        AnyOut out, bool chained) {
  CombineDims d;
  if (auto err = CheckCombine(y, weights, src_to_dst, *out, &d); err.failure()) return err;
  const int64_t m = d.m, hidden = d.hidden, k = d.k, tokens = d.tokens;
  if (tokens == 0 || hidden == 0) return ffi::Error::Success();
  return DispatchFloat(y.element_type(), "y", [&]<DType DT>() {
    using T = typename DevScalar<DT>::T;
    constexpr int kVec = 16 / sizeof(T);
    const auto* yp = static_cast<const T*>(y.untyped_data());
    auto* op = static_cast<T*>(out->untyped_data());
    const int vec = hidden % kVec == 0 ? kVec : 1;
    const int64_t units = hidden / vec;
    const int threads = vec == 1 ? 128 : (units >= 256 ? 256 : 64);
    // Few tokens (decode): a row is split over up to kSlices blocks so that
    // the launch is not a handful of blocks each walking a long row.
    constexpr int64_t kFewTokens = 512, kSlices = 8;
    const int64_t slices = tokens >= kFewTokens ? 1 : std::min<int64_t>(kSlices, CeilDiv(units, threads));
    const dim3 grid(GridFor(tokens, 1, 1u << 20), static_cast<unsigned>(slices));
    const bool pdl = chained && DeviceMajor() >= 9;
    return CudaError(LaunchKernel(vec == kVec ? CombineKernelT<DT, kVec> : CombineKernelT<DT, 1>,
                                  grid, threads, 0, stream, pdl, yp, weights.typed_data(),
                                  src_to_dst.typed_data(), tokens, static_cast<int>(k), m,
                                  hidden, op),
                     "moe_combine launch");
  });
}

namespace {

ffi::Error CombineCuda(cudaStream_t stream, ffi::AnyBuffer y, F32In weights, S32In src_to_dst,
                       AnyOut out) {
  return CombineSteps(stream, y, weights, src_to_dst, out, false);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kExpandCuda, ExpandCuda,
    ExpandSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kCombineCuda, CombineCuda,
    CombineSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
