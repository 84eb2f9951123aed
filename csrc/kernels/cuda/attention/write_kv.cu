// write_kv on the GPU: scatters new K/V rows into their cache slots, in
// place.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention/launch.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// One block per token (grid-stride); `Unit` is the copy granule. Slots outside
// [0, num_slots) are skipped. Duplicate slots race (Python rejects them eagerly).
template <typename Unit>
__global__ void WriteKvKernel(const Unit* __restrict__ k, const Unit* __restrict__ v,
                              const int32_t* __restrict__ slots, int64_t n,
                              int64_t units_per_row, int64_t num_slots, Unit* __restrict__ k_out,
                              Unit* __restrict__ v_out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;  // uniform over the block
    const Unit* ks = k + i * units_per_row;
    const Unit* vs = v + i * units_per_row;
    Unit* kd = k_out + s * units_per_row;
    Unit* vd = v_out + s * units_per_row;
    for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) {
      kd[u] = ks[u];
      vd[u] = vs[u];
    }
  }
}

template <typename Unit>
cudaError_t LaunchWriteKvUnits(cudaStream_t stream, const void* k, const void* v,
                               const int32_t* slots, int64_t n, int64_t row_bytes,
                               int64_t num_slots, void* k_out, void* v_out) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  WriteKvKernel<Unit><<<GridFor(n, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(k), static_cast<const Unit*>(v), slots, n, units, num_slots,
      static_cast<Unit*>(k_out), static_cast<Unit*>(v_out));
  return cudaGetLastError();
}

}  // namespace

// The copy granule is the widest of 16, 4 and 2 bytes that divides a row.
cudaError_t LaunchWriteKv(cudaStream_t stream, const void* k, const void* v,
                          const int32_t* slots, int64_t n, int64_t row_bytes, int64_t num_slots,
                          void* k_out, void* v_out) {
  if (n == 0 || row_bytes == 0) return cudaSuccess;
  if (row_bytes % 16 == 0)
    return LaunchWriteKvUnits<uint4>(stream, k, v, slots, n, row_bytes, num_slots, k_out, v_out);
  if (row_bytes % 4 == 0)
    return LaunchWriteKvUnits<uint32_t>(stream, k, v, slots, n, row_bytes, num_slots, k_out,
                                        v_out);
  return LaunchWriteKvUnits<uint16_t>(stream, k, v, slots, n, row_bytes, num_slots, k_out,
                                      v_out);
}

}  // namespace jax_moe
