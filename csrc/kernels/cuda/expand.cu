// Step 3 on the GPU: expand (gather token rows into expert order), whole rows
// with 16-byte accesses whenever the row length allows.
#include "kernels/cuda/expand.h"

#include "kernels/cuda/cuda_common.cuh"

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
cudaError_t LaunchExpandT(cudaStream_t stream, const void* x, const int32_t* d2s, int64_t m,
                          int64_t row_bytes, int64_t limit, int64_t topk, void* out) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  ExpandKernel<Unit><<<GridFor(m, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(x), d2s, m, units, limit, topk, static_cast<Unit*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchExpand(cudaStream_t stream, const void* x, int64_t tokens, int64_t row_bytes,
                         const int32_t* dst_to_src, int64_t m, int64_t topk, void* out) {
  if (m == 0 || row_bytes == 0) return cudaSuccess;
  const int64_t limit = tokens * topk;
  if (row_bytes % 16 == 0)
    return LaunchExpandT<uint4>(stream, x, dst_to_src, m, row_bytes, limit, topk, out);
  if (row_bytes % 4 == 0)
    return LaunchExpandT<uint32_t>(stream, x, dst_to_src, m, row_bytes, limit, topk, out);
  return LaunchExpandT<uint16_t>(stream, x, dst_to_src, m, row_bytes, limit, topk, out);
}

}  // namespace jax_moe
