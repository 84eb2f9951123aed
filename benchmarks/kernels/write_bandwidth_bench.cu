// The GPU's memory ceilings that the weight gradient is measured against:
// bytes per second that a kernel reads, writes and copies, and writes in the
// weight gradient's pattern (128 x 256 bf16 tiles of out[e] (n, k),
// row-major, tiles along M within each expert, as the Hopper kernel hands
// them out), both by plain 16-byte stores and by TMA stores of 128 x 64
// subtiles from shared memory with 2, 4 or 8 buffers in flight (the store
// path of the CUTLASS epilogue, without its MMAs).
// Buffers of 15 GiB (about DeepSeek-V3's w13 gradient); CUDA events, median of
// 5 launches after one warm-up. Stored values are not zero (and memset is
// timed for comparison with both zero and non-zero bytes).
//
// Build: see wgrad_bench.cu (ninja -C build write_bandwidth_bench).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>

#include "bench_util.cuh"

namespace {

constexpr int kThreads = 256;

__global__ void ReadKernel(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

__global__ void WriteKernel(uint4* p, size_t n, uint32_t salt) {
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads) {
    const uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    p[i] = make_uint4(h, h * 3u + 1u, h ^ 0x5bd1e995u, h + 7u);
  }
}

__global__ void CopyKernel(const uint4* a, uint4* b, size_t n) {
  for (size_t i = blockIdx.x * size_t{kThreads} + threadIdx.x; i < n; i += size_t{gridDim.x} * kThreads)
    b[i] = a[i];
}

// The gradient out (experts, n, k) bf16 in 128 x 256 tiles; tile t: expert
// t / tiles_e, then along M within the expert.
struct Pattern {
  const char* name;
  int experts, n, k;
  __host__ __device__ int64_t Tiles() const { return int64_t{experts} * (n / 128) * (k / 256); }
  __host__ __device__ double Bytes() const { return 2.0 * experts * n * k; }
};

__device__ __forceinline__ void TileOrigin(const Pattern& p, int64_t t, int64_t* row, int* col) {
  const int tm = p.n / 128, tn = p.k / 256;
  const int64_t e = t / (int64_t{tm} * tn);
  const int r = static_cast<int>(t % (int64_t{tm} * tn));
  *row = e * p.n + (r % tm) * 128;  // row of the (experts * n, k) matrix
  *col = (r / tm) * 256;
}

// A warp stores 512 bytes of one row per instruction.
__global__ void __launch_bounds__(kThreads) TileStoreKernel(uint16_t* out, Pattern p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t t = blockIdx.x; t < p.Tiles(); t += gridDim.x) {
    int64_t row;
    int col;
    TileOrigin(p, t, &row, &col);
    for (int r = warp; r < 128; r += kThreads / 32) {
      const uint32_t h = static_cast<uint32_t>(t * 131 + r) * 2654435761u ^ lane;
      reinterpret_cast<uint4*>(out + (row + r) * p.k + col)[lane] = make_uint4(h, h + 1, h + 2, h + 3);
    }
  }
}

// One thread issues the TMA stores: 4 subtiles of 128 x 64 a tile, from
// kBufs shared buffers (filled once), waiting before reusing a buffer until
// at most kBufs - 1 stores still read shared memory.
template <int kBufs>
__global__ void __launch_bounds__(128) TileTmaStoreKernel(const __grid_constant__ CUtensorMap map,
                                                          Pattern p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < kBufs * 4096; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = static_cast<uint32_t>(i) * 2654435761u + 12345u;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x != 0) return;
  int buf = 0;
  for (int64_t t = blockIdx.x; t < p.Tiles(); t += gridDim.x) {
    int64_t row;
    int col;
    TileOrigin(p, t, &row, &col);
    for (int s = 0; s < 4; ++s) {
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kBufs - 1) : "memory");
      const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem + buf * 16384));
      asm volatile(
          "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(&map),
          "r"(col + s * 64), "r"(static_cast<int>(row)), "r"(src)
          : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      buf = (buf + 1) % kBufs;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <class F>
void Report(const char* what, double bytes, F&& launch) {
  launch(0);
  CK(cudaDeviceSynchronize());
  const double us = MedianLaunchMicros(launch, 1, 5);
  printf("%-40s %9.1f us  %6.3f TB/s\n", what, us, bytes / us / 1e6);
}

template <int kBufs>
void TimeTma(const CUtensorMap& map, const Pattern& p, int sms, int per_sm) {
  CK(cudaFuncSetAttribute(TileTmaStoreKernel<kBufs>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          kBufs * 16384));
  char what[64];
  snprintf(what, sizeof what, "  TMA store, %d buffers, %d CTA/SM", kBufs, per_sm);
  Report(what, p.Bytes(), [&](int) {
    TileTmaStoreKernel<kBufs><<<sms * per_sm, 128, kBufs * 16384>>>(map, p);
  });
}

}  // namespace

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t bytes = size_t{15} << 30;
  uint8_t *a, *b;
  uint32_t* sink;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(b, 1, bytes));
  const size_t vecs = bytes / 16;
  for (int per_sm : {4, 8, 16}) {
    const int grid = sms * per_sm;
    printf("linear, %d blocks of %d threads\n", grid, kThreads);
    Report("  write", bytes, [&](int) { WriteKernel<<<grid, kThreads>>>((uint4*)a, vecs, 0x9e3779b9u); });
    Report("  read", bytes, [&](int) { ReadKernel<<<grid, kThreads>>>((const uint4*)a, vecs, sink); });
    Report("  copy (bytes read + written)", bytes,
           [&](int) { CopyKernel<<<grid, kThreads>>>((const uint4*)b, (uint4*)a, vecs / 2); });
  }
  Report("memset 0", bytes, [&](int) { CK(cudaMemsetAsync(a, 0, bytes)); });
  Report("memset 0x5a", bytes, [&](int) { CK(cudaMemsetAsync(a, 0x5a, bytes)); });

  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult found;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                      12000, cudaEnableDefault, &found));
  if (encode == nullptr || found != cudaDriverEntryPointSuccess) {
    printf("no cuTensorMapEncodeTiled: TMA rows skipped\n");
    return 1;
  }
  const Pattern patterns[] = {{"DeepSeek-V3 w13 gradient", 256, 4096, 7168},
                              {"DeepSeek-V3 w2 gradient", 256, 7168, 2048}};
  for (const Pattern& p : patterns) {
    printf("%s: E %d, n %d, k %d (%.2f GB)\n", p.name, p.experts, p.n, p.k, p.Bytes() / 1e9);
    for (int per_sm : {1, 2, 4}) {
      char what[64];
      snprintf(what, sizeof what, "  16-byte stores, %d CTA/SM", per_sm);
      Report(what, p.Bytes(), [&](int) { TileStoreKernel<<<sms * per_sm, kThreads>>>((uint16_t*)a, p); });
    }
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.k),
                                static_cast<cuuint64_t>(p.experts) * p.n};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.k) * 2};
    const cuuint32_t box[2] = {64, 128}, elem_strides[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a, dims, strides, box, elem_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      printf("cuTensorMapEncodeTiled failed\n");
      return 1;
    }
    for (int per_sm : {1, 2}) {
      TimeTma<2>(map, p, sms, per_sm);
      TimeTma<4>(map, p, sms, per_sm);
      TimeTma<8>(map, p, sms, per_sm);
    }
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(sink));
  return 0;
}
