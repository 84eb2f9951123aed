// One token's routed experts with block-scaled fp8 weights in one kernel
// (moe_decode_fp8): steps 3-7 of the layer after the router.
//
// Why one kernel: at one token the layer is a read of the k chosen experts'
// fp8 weights and little else; as separate steps (token index, expand, two
// GEMMs, activation, combine) each step pays a launch gap and a ramp. Here a
// resident grid (cooperative launch) does, with grid-wide barriers between:
//   0. every block quantises x into shared memory (fp8_quant.cuh);
//   1. warp items (slot, 8 act columns): the gate and up rows of those
//      columns (16 weight rows) on tensor cores as the decode GEMM does
//      (Fp8LoadBlockCodes / Fp8MmaBlock), then act in f32 to a scratch;
//      plain activations take 16 act columns an item;
//   2. warp items (slot, 16 rows of w2) write y to a scratch, each block a
//      contiguous run of them after quantising the act rows of the slots in
//      its run into shared memory;
//   3. out = sum over the slots in order of weight * y.
// Rounding points are the step chain's (h, act and y in x's dtype, f32
// sums); the order of every sum is fixed, so the result is the same bits run
// to run. Phase timings: benchmarks/kernels/moe_decode_fp8_bench.cu.
#include "kernels/cuda/moe_decode_fp8.h"

#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/fp8_e4m3.h"
#include "kernels/cuda/act_math.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/fp8_quant.cuh"

namespace jax_moe {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Phase timestamps, in the benchmark's build only (JAX_MOE_DECODE_FP8_STAMPS,
// kernels/cuda/moe_decode_fp8.h): block b writes globaltimer at point i to
// g_fp8_stamps[b * kFp8StampStride + i].
#ifdef JAX_MOE_DECODE_FP8_STAMPS
__device__ unsigned long long* g_fp8_stamps;
#define FP8_STAMP(i) StampGlobaltimer(g_fp8_stamps, kFp8StampStride, (i))
#else
#define FP8_STAMP(i) \
  do {               \
  } while (0)
#endif

__device__ __forceinline__ float ActOf(int64_t act, float g) {
  if (act == kGeluExact) return Act<kGeluExact>(g);
  if (act == kGeluTanh) return Act<kGeluTanh>(g);
  return Act<kSilu>(g);
}

// A warp item's two weight rows, lo and hi (rows g and g + 8 of the mma's
// 16; lane (g, q)), each with its own scale row, and whether each is real.
struct WarpJob {
  const uint8_t* w_lo;  // the row's codes + 16 q
  const uint8_t* w_hi;
  const float* ws_lo;   // the row's scale row (one scale per 128-channel block)
  const float* ws_hi;
  bool lo_ok, hi_ok;
};

// 128-channel blocks a warp has in flight: 8 loads of 16 bytes a lane.
constexpr int kDepth = 2;

__device__ __forceinline__ void LoadBlocks(Fp8BlockCodes (&a)[kDepth], const WarpJob& j,
                                           int64_t b, int64_t kb, int64_t k, int q) {
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
    Fp8LoadBlockCodes(a[d], j.w_lo, j.w_hi, b + d, kb, k, j.lo_ok, j.hi_ok, q);
}

// The job's f32 sums for token 0 of both rows against the quantised row
// xrow (codes + 16 q, scales sxr), kb blocks of 128 channels.
__device__ __forceinline__ void WarpRows(const WarpJob& j, const uint8_t* xrow, const float* sxr,
                                         int64_t kb, int64_t k, int q, float& acc_lo,
                                         float& acc_hi) {
  acc_lo = acc_hi = 0.f;
  for (int64_t b = 0; b < kb; b += kDepth) {
    Fp8BlockCodes a[kDepth];
    LoadBlocks(a, j, b, kb, k, q);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (b + d >= kb) break;
      float c4[4];
      Fp8MmaBlock(c4, a[d], xrow + (b + d) * kFp8Block);
      const float s = sxr[b + d];
      acc_lo = fmaf(c4[0], s * __ldg(j.ws_lo + b + d), acc_lo);
      acc_hi = fmaf(c4[2], s * __ldg(j.ws_hi + b + d), acc_hi);
    }
  }
}

template <DType DT>
__global__ void __launch_bounds__(kThreads) MoeDecodeFp8Kernel(MoeDecodeFp8Problem p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_ids[kDecodeFp8MaxTopk];
  __shared__ float s_wts[kDecodeFp8MaxTopk];
  FP8_STAMP(0);
  const int64_t H = p.hidden, I = p.inter, E = p.experts;
  const int k = static_cast<int>(p.topk);
  const int64_t kbh = (H + kFp8Block - 1) / kFp8Block, kbi = (I + kFp8Block - 1) / kFp8Block;
  const int64_t n13 = p.gated ? 2 * I : I, nb13 = (n13 + kFp8Block - 1) / kFp8Block;
  // Shared memory: x's codes [kbh * 128], the slots' act codes [k][kbi * 128],
  // then x's scales [kbh] and act's [k][kbi].
  uint8_t* xq = smem;
  uint8_t* aq = xq + kbh * kFp8Block;
  float* sx = reinterpret_cast<float*>(aq + k * kbi * kFp8Block);
  float* sa = sx + kbh;

  if (threadIdx.x < k) {
    const int e = p.ids[threadIdx.x];
    s_ids[threadIdx.x] = e >= 0 && e < E ? e : -1;
    s_wts[threadIdx.x] = p.weights[threadIdx.x];
  }
  __syncthreads();  // s_ids
  FP8_STAMP(1);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  cg::grid_group grid = cg::this_grid();

  // Step 1: item (slot j, act columns [i0, i0 + cols)). Gated: mma rows g
  // and g + 8 are gate row i0 + g and up row I + i0 + g; plain: rows i0 + g
  // and i0 + 8 + g. Every lane holds token 0's sums (all the mma's token
  // columns read x's one row); lanes with q == 0 write.
  const int cols1 = p.gated ? 8 : 16;
  const int64_t per_slot1 = (I + cols1 - 1) / cols1, items1 = k * per_slot1;
  auto job1 = [&](int64_t item) {
    const int j = static_cast<int>(item / per_slot1);
    const int64_t i0 = item % per_slot1 * cols1;
    const int64_t e = s_ids[j] < 0 ? 0 : s_ids[j];
    const int64_t lo_row = i0 + g, hi_row = p.gated ? I + i0 + g : i0 + 8 + g;
    const uint8_t* w = p.w13 + e * n13 * H + q * 16;
    const float* ws = p.w13_scale + e * nb13 * kbh;
    // A 16-row warp group lies in one 128-row scale block: i0 % 8 == 0 and I % 16 == 0.
    const int64_t lo_blk = i0 / kFp8Block, hi_blk = (p.gated ? I + i0 : i0 + 8) / kFp8Block;
    return WarpJob{w + lo_row * H, w + hi_row * H, ws + lo_blk * kbh, ws + hi_blk * kbh,
                   s_ids[j] >= 0 && i0 + g < I,
                   s_ids[j] >= 0 && (p.gated ? i0 + g < I : i0 + 8 + g < I)};
  };
  using S = Fp8Storage<DT>;
  Fp8QuantiseRows<DT, kFp8QuantBatch>(static_cast<const S*>(p.x), H, 1, xq, sx, kbh);
  FP8_STAMP(2);
  for (int64_t item = first; item < items1; item += stride) {
    const int j = static_cast<int>(item / per_slot1);
    const int64_t i0 = item % per_slot1 * cols1;
    const bool live = s_ids[j] >= 0;
    float lo, hi;
    WarpRows(job1(item), xq + q * 16, sx, kbh, H, q, lo, hi);
    if (q == 0) {
      float* act = p.act + static_cast<int64_t>(j) * I + i0;
      if (p.gated) {
        if (i0 + g < I)
          act[g] = live ? Round<DT>(ActOf(p.activation, Round<DT>(lo)) * Round<DT>(hi)) : 0.f;
      } else {
        if (i0 + g < I) act[g] = live ? Round<DT>(ActOf(p.activation, Round<DT>(lo))) : 0.f;
        if (i0 + 8 + g < I)
          act[8 + g] = live ? Round<DT>(ActOf(p.activation, Round<DT>(hi))) : 0.f;
      }
    }
  }
  FP8_STAMP(3);
  grid.sync();  // every slot's act written
  FP8_STAMP(4);

  // Step 2: item (slot j, w2 rows [r0, r0 + 16)).
  const int64_t per_slot2 = (H + 15) / 16, items2 = k * per_slot2;
  auto job2 = [&](int64_t item) {
    const int j = static_cast<int>(item / per_slot2);
    const int64_t r0 = item % per_slot2 * 16;
    const int64_t e = s_ids[j] < 0 ? 0 : s_ids[j];
    const uint8_t* w_lo = p.w2 + (e * H + r0 + g) * I + q * 16;
    const float* ws = p.w2_scale + (e * kbh + r0 / kFp8Block) * kbi;
    return WarpJob{w_lo, w_lo + 8 * I, ws, ws, s_ids[j] >= 0 && r0 + g < H,
                   s_ids[j] >= 0 && r0 + g + 8 < H};
  };

  // A block takes a contiguous run of items, its warps strided over it, so
  // that it quantises only the act rows of the slots in the run (one or two
  // when the grid has at least k blocks) instead of all k, which in every
  // block would be the kernel's largest fixed cost.
  const int64_t per_block2 = (items2 + gridDim.x - 1) / gridDim.x;
  const int64_t lo2 = blockIdx.x * per_block2;
  const int64_t hi2 = lo2 + per_block2 < items2 ? lo2 + per_block2 : items2;
  if (lo2 < hi2) {  // uniform in the block
    const int64_t j0 = lo2 / per_slot2, j1 = (hi2 - 1) / per_slot2;
    Fp8QuantiseRows<DType::F32, kFp8QuantBatch>(p.act + j0 * I, I,
                                                static_cast<int>(j1 - j0 + 1),
                                                aq + j0 * kbi * kFp8Block, sa + j0 * kbi, kbi);
  }
  FP8_STAMP(5);
  for (int64_t item = lo2 + warp; item < hi2; item += kWarps) {
    const int j = static_cast<int>(item / per_slot2);
    const int64_t r0 = item % per_slot2 * 16;
    float lo, hi;
    WarpRows(job2(item), aq + static_cast<int64_t>(j) * kbi * kFp8Block + q * 16, sa + j * kbi,
             kbi, I, q, lo, hi);
    if (q == 0) {
      float* y = p.y + static_cast<int64_t>(j) * H + r0;
      if (r0 + g < H) y[g] = s_ids[j] < 0 ? 0.f : Round<DT>(lo);
      if (r0 + g + 8 < H) y[g + 8] = s_ids[j] < 0 ? 0.f : Round<DT>(hi);
    }
  }
  FP8_STAMP(6);
  grid.sync();  // every slot's y written
  FP8_STAMP(7);

  // Step 3: the combine, slots in order.
  using T = typename DevScalar<DT>::T;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < H;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    float o = 0.f;
    for (int j = 0; j < k; ++j)
      if (s_ids[j] >= 0) o += s_wts[j] * __ldcg(p.y + static_cast<int64_t>(j) * H + c);
    static_cast<T*>(p.out)[c] = DevScalar<DT>::Store(o);
  }
  FP8_STAMP(8);
}

}  // namespace

#ifdef JAX_MOE_DECODE_FP8_STAMPS
cudaError_t SetMoeDecodeFp8Stamps(unsigned long long* stamps) {
  return cudaMemcpyToSymbol(g_fp8_stamps, &stamps, sizeof(stamps));
}
#endif

int64_t MoeDecodeFp8Smem(int64_t hidden, int64_t inter, int64_t topk) {
  const int64_t kbh = (hidden + kFp8Block - 1) / kFp8Block;
  const int64_t kbi = (inter + kFp8Block - 1) / kFp8Block;
  return (kbh + topk * kbi) * (kFp8Block + 4);
}

cudaError_t LaunchMoeDecodeFp8(cudaStream_t stream, DType dtype, const MoeDecodeFp8Problem& p) {
  if (p.hidden <= 0 || p.inter <= 0 || p.topk <= 0 || p.topk > kDecodeFp8MaxTopk ||
      p.hidden % kDecodeFp8Multiple || p.inter % kDecodeFp8Multiple ||
      p.hidden > kDecodeFp8MaxHidden || p.inter > kDecodeFp8MaxInter)
    return cudaErrorInvalidValue;
  const int smem = static_cast<int>(MoeDecodeFp8Smem(p.hidden, p.inter, p.topk));
  auto launch = [&]<DType DT>() -> cudaError_t {
    constexpr auto kernel = MoeDecodeFp8Kernel<DT>;
    // Opted in once per device, to the most any call within the limits asks for.
    const int cap = static_cast<int>(std::min<int64_t>(
        MoeDecodeFp8Smem(kDecodeFp8MaxHidden, kDecodeFp8MaxInter, kDecodeFp8MaxTopk),
        DeviceSmemOptin()));
    if (smem > cap) return cudaErrorInvalidConfiguration;
    if (cudaError_t e = EnsureDynamicSmem<kernel>(cap); e != cudaSuccess) return e;
    int per_sm = 0;
    cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
    if (err != cudaSuccess) return err;
    if (per_sm <= 0) return cudaErrorInvalidConfiguration;
    // Enough blocks for the larger step's warp items, at most what is resident.
    const int64_t cols = p.gated ? 8 : 16;
    const int64_t items =
        std::max(p.topk * ((p.inter + cols - 1) / cols), p.topk * ((p.hidden + 15) / 16));
    const int64_t grid = std::max<int64_t>(
        1, std::min<int64_t>((items + kWarps - 1) / kWarps,
                             static_cast<int64_t>(per_sm) * DeviceSms()));
    return LaunchCooperative(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                             static_cast<size_t>(smem), stream, p);
  };
  switch (dtype) {
    case DType::F32: return launch.template operator()<DType::F32>();
    case DType::BF16: return launch.template operator()<DType::BF16>();
    case DType::F16: return launch.template operator()<DType::F16>();
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace jax_moe
