// write_kv on the GPU: scatters new K/V rows into their cache slots, in
// place.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/attention/launch.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// One block per token (grid-stride); `Unit` is the copy granule, k_units and
// v_units of them per K and V row. Slots outside [0, num_slots) are skipped.
// Duplicate slots race (Python rejects them eagerly).
template <typename Unit>
__global__ void WriteKvKernel(const Unit* __restrict__ k, const Unit* __restrict__ v,
                              const int32_t* __restrict__ slots, int64_t n, int64_t k_units,
                              int64_t v_units, int64_t num_slots, Unit* __restrict__ k_out,
                              Unit* __restrict__ v_out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;  // uniform over the block
    const Unit* ks = k + i * k_units;
    const Unit* vs = v + i * v_units;
    Unit* kd = k_out + s * k_units;
    Unit* vd = v_out + s * v_units;
    for (int64_t u = threadIdx.x; u < k_units; u += blockDim.x) kd[u] = ks[u];
    for (int64_t u = threadIdx.x; u < v_units; u += blockDim.x) vd[u] = vs[u];
  }
}

template <typename Unit>
cudaError_t LaunchWriteKvUnits(cudaStream_t stream, const void* k, const void* v,
                               const int32_t* slots, int64_t n, int64_t k_row_bytes,
                               int64_t v_row_bytes, int64_t num_slots, void* k_out,
                               void* v_out) {
  constexpr int64_t kUnit = sizeof(Unit);
  const int64_t k_units = k_row_bytes / kUnit, v_units = v_row_bytes / kUnit;
  const int64_t units = k_units > v_units ? k_units : v_units;
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  WriteKvKernel<Unit><<<GridFor(n, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(k), static_cast<const Unit*>(v), slots, n, k_units, v_units,
      num_slots, static_cast<Unit*>(k_out), static_cast<Unit*>(v_out));
  return cudaGetLastError();
}

}  // namespace

// The copy granule is the widest of 16, 4 and 2 bytes that divides both rows.
cudaError_t LaunchWriteKv(cudaStream_t stream, const void* k, const void* v,
                          const int32_t* slots, int64_t n, int64_t k_row_bytes,
                          int64_t v_row_bytes, int64_t num_slots, void* k_out, void* v_out) {
  if (n == 0 || (k_row_bytes == 0 && v_row_bytes == 0)) return cudaSuccess;
  const int64_t rows = k_row_bytes | v_row_bytes;  // divisible by u iff both rows are (u = 2^i)
  if (rows % 16 == 0)
    return LaunchWriteKvUnits<uint4>(stream, k, v, slots, n, k_row_bytes, v_row_bytes, num_slots,
                                     k_out, v_out);
  if (rows % 4 == 0)
    return LaunchWriteKvUnits<uint32_t>(stream, k, v, slots, n, k_row_bytes, v_row_bytes,
                                        num_slots, k_out, v_out);
  return LaunchWriteKvUnits<uint16_t>(stream, k, v, slots, n, k_row_bytes, v_row_bytes,
                                      num_slots, k_out, v_out);
}

}  // namespace jax_moe
