// fill_rows on the GPU: the rows past a device-side count become 0 (or all
// of them NaN), in place.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/cuda/attention/launch.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// Rows >= ctrl[0] of x (rows x units_per_row units) become `zero`, or with
// ctrl[1] != 0 every unit becomes `nan`. Read on the device: no host sync.
// With no padding row the blocks exit at once, so the call costs a launch.
template <typename Unit>
__global__ void FillRowsKernel(Unit* __restrict__ x, const int32_t* __restrict__ ctrl,
                               int64_t rows, int64_t units_per_row, Unit zero, Unit nan) {
  const bool poison = ctrl[1] != 0;
  const int64_t s = ctrl[0];
  const int64_t start = poison ? 0 : (s < 0 ? 0 : (s > rows ? rows : s));
  const int64_t total = (rows - start) * units_per_row;
  Unit* base = x + start * units_per_row;
  const Unit v = poison ? nan : zero;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x)
    base[i] = v;
}

template <typename Unit>
cudaError_t LaunchFillRowsUnits(cudaStream_t stream, void* x, const int32_t* ctrl, int64_t rows,
                                int64_t row_bytes, Unit zero, Unit nan) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  FillRowsKernel<Unit><<<GridFor(rows * units, 256, 1024), 256, 0, stream>>>(
      static_cast<Unit*>(x), ctrl, rows, units, zero, nan);
  return cudaGetLastError();
}

}  // namespace

// The fill granule is the widest of 16, 4 and 2 bytes that divides a row
// (4-byte floats: 16 or 4).
cudaError_t LaunchFillRows(cudaStream_t stream, DType dtype, void* x, const int32_t* ctrl,
                           int64_t rows, int64_t row_bytes) {
  if (rows == 0 || row_bytes == 0) return cudaSuccess;
  const uint32_t nan = NanBits(dtype);
  if (dtype == DType::F32) {
    if (row_bytes % 16 == 0)
      return LaunchFillRowsUnits<uint4>(stream, x, ctrl, rows, row_bytes, make_uint4(0, 0, 0, 0),
                                        make_uint4(nan, nan, nan, nan));
    return LaunchFillRowsUnits<uint32_t>(stream, x, ctrl, rows, row_bytes, 0u, nan);
  }
  const uint32_t nan2 = nan | (nan << 16);  // two 16-bit NaNs
  if (row_bytes % 16 == 0)
    return LaunchFillRowsUnits<uint4>(stream, x, ctrl, rows, row_bytes, make_uint4(0, 0, 0, 0),
                                      make_uint4(nan2, nan2, nan2, nan2));
  if (row_bytes % 4 == 0)
    return LaunchFillRowsUnits<uint32_t>(stream, x, ctrl, rows, row_bytes, 0u, nan2);
  return LaunchFillRowsUnits<uint16_t>(stream, x, ctrl, rows, row_bytes, uint16_t{0},
                                       static_cast<uint16_t>(nan));
}

}  // namespace jax_moe
