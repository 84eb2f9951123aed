// Steps 4 and 6 on the GPU: out[rows of group e] = x[rows of e] @ w[e]^T with
// f32 accumulation; rows past sum(expert_sizes) are zero. Same semantics as
// csrc/kernels/cpu/group_gemm.cc: negative sizes count as 0 and groups are
// clamped to M. This file picks the kernel for a call (LaunchGroupGemm<DT>)
// and is the one translation unit that instantiates them all; the kernel
// families live in the headers beside it.
//
// Design
//  * One launch, no host sync: the grid has an upper bound of "m-slots"
//    (min(ceil(M/BM) + E, M) + 1 >= sum_e ceil(rows_e/BM) + 1) times ceil(N/BN) column
//    tiles. Every block recomputes the per-expert tile schedule from
//    expert_sizes on the device (a block-wide prefix scan, 1024 experts per
//    pass) and finds the (expert, row tile) its m-slot owns. Slots past the
//    last tile are "spare": together they zero the tail rows [sum, M).
//    (schedule.cuh)
//  * The grid is 1-D and grouped: kGroupM m-slots walk the column tiles
//    together so that the blocks in flight share x row tiles and w[e] column
//    tiles in L2 (a plain 2-D grid would stream all of x once per column tile).
//    A grid-stride loop over the linear block id removes every grid-size limit.
//  * bf16/f16: tensor cores (mma.sync m16n8k16 fed by ldmatrix), f32
//    accumulate. BMx128x32 tiles with BM = 32, 64 or 128 (the caller's tile_m:
//    a few rows per expert would waste most of a 128-row tile), 8 warps of
//    (BM/2)x32, a 3-stage cp.async pipeline in dynamic shared memory.
//    (mma_tile.cuh)
//  * bf16/f16 with tile_m = 8 (decode: a handful of rows per expert): the
//    "skinny" kernel streams each expert's weights once with 16-byte loads
//    straight into mma registers (swap-AB: weight rows are the mma's M side,
//    the <= 8 token rows its N side), K split over 8 warps and summed in a
//    fixed order. Needs K % 8 == 0 and 16-byte aligned x and w; otherwise
//    the BM = 32 kernel runs instead. Large decode launches run it
//    persistent: one resident grid that scans the schedule once per block
//    into shared memory and walks only the real tiles (no per-tile scan, no
//    spare blocks), which reaches more of the weight bandwidth at 16-128
//    tokens on the H200 (docs/performance.md). Both forms sum K in the same
//    order, so they give the same bits. (decode.cuh)
//  * bf16/f16 with tile_m = 16 on compute capability 9.0+ (decode, 2-128
//    tokens): the TMA kernel, persistent and warp-specialised: a producer
//    warp streams 128 weight rows x 64 k per stage with the tensor memory
//    accelerator, eight consumer warps multiply them by up to 16 token rows.
//    It streams the weights faster than the skinny kernel on the H200
//    (docs/performance.md). Launches of fewer than 6 tiles per SM (1.5 from
//    K = 8192), and everything it cannot take, run tile 8. (tma_decode.cuh)
//  * Fused gather (step 3): with `gather`, row r of the GEMM input is
//    x[rows[r] / topk] (zero where rows[r] is outside [0, x_rows * topk)),
//    read in the A-load, so the expanded copy of x is never written.
//  * f32: exact-f32 SIMT FMA (no TF32): 128x128x8 tiles, 8x8 outputs per
//    thread, operands transposed into shared memory, register prefetch of the
//    next k tile. (simt_f32.cuh)
//  * Edges: 16-byte loads/stores only where the row is 16-byte aligned and the
//    whole vector is in bounds; everything else goes element by element with
//    zero fill, so any M, N, K (odd ones too) is safe.
//  * tile_m = 256 asks for the Hopper kernel (gemm_sm90a.cu, CUTLASS wgmma +
//    TMA, built when JAX_MOE_WITH_SM90), which the group_gemm handler runs
//    when it applies (a compute capability 9.0 device, bf16/f16, N and K
//    multiples of 8, the scratch output sized for it); else the 128-row tile
//    runs instead: the same results up to the order of the K sums.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/decode.cuh"
#include "kernels/cuda/group_gemm/fp8_simt.cuh"
#include "kernels/cuda/group_gemm/fp8_skinny.cuh"
#include "kernels/cuda/group_gemm/launch.h"
#include "kernels/cuda/group_gemm/mma_tile.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"
#include "kernels/cuda/group_gemm/simt_f32.cuh"
#include "kernels/cuda/group_gemm/tma_decode.cuh"

namespace jax_moe {
namespace {

// Launches the kernel for one dtype and tile on `stream`; nothing else (no
// sync, no allocation). m > 0 and n > 0. tile_m is 8, 16, 32, 64 or 128 (256
// is resolved by the caller).
// pdl: launched with programmatic stream serialisation (after another
// kernel of this call, whose output it may read).
template <DType DT>
cudaError_t LaunchGroupGemm(cudaStream_t stream, const void* x, const void* w,
                            const int32_t* sizes, void* out, const GemmDims& d,
                            const int32_t* rows, int64_t topk, int64_t tile_m, bool pdl = false,
                            bool wait_first = false) {
  GemmArgs a{};
  a.wait_first = wait_first;
  a.m = d.m;
  a.n = d.n;
  a.k = d.k;
  a.src = RowSource{rows, topk, d.x_rows * topk};
  if constexpr (DT == DType::F32) {
    const auto* xp = static_cast<const float*>(x);
    const auto* wp = static_cast<const float*>(w);
    auto* op = static_cast<float*>(out);
    a.vec_in = d.k % 4 == 0 && Aligned16(xp) && Aligned16(wp);
    a.vec_out = d.n % 4 == 0 && Aligned16(op);
    const unsigned grid = Schedule(a, d.groups, kBMf, kBN);  // f32: one tile shape
    return LaunchKernel(GroupGemmF32Kernel, grid, kThreads, 0, stream, pdl, xp, wp, sizes, op, a);
  } else {
    using T = std::conditional_t<DT == DType::BF16, __nv_bfloat16, __half>;
    const auto* xp = static_cast<const uint16_t*>(x);
    const auto* wp = static_cast<const uint16_t*>(w);
    auto* op = static_cast<uint16_t*>(out);
    a.vec_in = d.k % 8 == 0 && Aligned16(xp) && Aligned16(wp);
    a.vec_out = d.n % 8 == 0 && Aligned16(op);
    // The decode kernels only do 16-byte loads.
    if ((tile_m == 8 || tile_m == 16) && !a.vec_in) tile_m = 32;
    if (tile_m == 16) {
      // The TMA kernel: compute capability 9.0+, at most kPersistMaxE experts,
      // coordinates in int32, and enough tiles (fewer, and the block-per-tile
      // skinny kernel balances the SMs better). Otherwise tile 8.
      // TMA coordinates are int32: rows up to E*N + 127, k up to K + 63.
      constexpr int64_t kCoordMax = (int64_t{1} << 31) - 256;
      if (DeviceMajor() >= 9 && PersistScheduleFits(d.groups, d.m) &&
          d.groups * d.n < kCoordMax && d.k < kCoordMax) {
        bool ran = false;
        const cudaError_t err = LaunchTma<T, kTmaConsumers, kTmaStages, kTmaBoxes>(
            stream, xp, wp, sizes, op, a, d.groups, kTmaMinPerSm, pdl, &ran);
        if (err != cudaSuccess || ran) return err;
      }
      tile_m = 8;
    }
    switch (tile_m) {
      case 8: {
        const unsigned grid = Schedule(a, d.groups, kSR, kSBN);
        const int resident = ResidentBlocks<GroupGemmSkinnyPersistentKernel<T>>(kThreads);
        if (resident > 0 && PersistScheduleFits(d.groups, d.m) &&
            (a.total_blocks >= kPersistWaves * resident ||
             SkinnyPersistentWins(a, d.groups, ResidentBlocks<GroupGemmSkinnyKernel<T>>(kThreads),
                                  resident)))
          return LaunchKernel(GroupGemmSkinnyPersistentKernel<T>, static_cast<unsigned>(resident),
                              kThreads, 0, stream, pdl, xp, wp, sizes, op, a);
        return LaunchKernel(GroupGemmSkinnyKernel<T>, grid, kThreads, 0, stream, pdl, xp, wp,
                            sizes, op, a);
      }
      case 32:
        return LaunchMma<T, 32, kBN>(stream, xp, wp, sizes, op, a, d.groups, pdl);
      case 64:
        return LaunchMma<T, 64, kBN>(stream, xp, wp, sizes, op, a, d.groups, pdl);
      default:
        // 128 x 256 (64 x 64 warp tiles) ran correct but no faster than 128 x
        // 128 on the H200 (docs/performance.md): one block per SM hides less
        // latency. MmaTile keeps the BN parameter for the next try.
        return LaunchMma<T, 128, kBN>(stream, xp, wp, sizes, op, a, d.groups, pdl);
    }
  }
}

// launch.template operator()<DT>() for the DType of `dtype` (f32, bf16, else f16).
template <typename Launch>
cudaError_t WithFloatDType(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::F32:
      return launch.template operator()<DType::F32>();
    case DType::BF16:
      return launch.template operator()<DType::BF16>();
    default:
      return launch.template operator()<DType::F16>();
  }
}

}  // namespace

cudaError_t LaunchGroupGemmFor(cudaStream_t stream, DType dtype, const void* x,
                               const void* w, const int32_t* sizes, void* out, const GemmDims& d,
                               const int32_t* rows, int64_t topk, int64_t tile_m, bool pdl,
                               bool wait_first) {
  switch (dtype) {
    case DType::F32:
      return LaunchGroupGemm<DType::F32>(stream, x, w, sizes, out, d, rows, topk, tile_m, pdl,
                                         wait_first);
    case DType::BF16:
      return LaunchGroupGemm<DType::BF16>(stream, x, w, sizes, out, d, rows, topk, tile_m, pdl,
                                          wait_first);
    default:
      return LaunchGroupGemm<DType::F16>(stream, x, w, sizes, out, d, rows, topk, tile_m, pdl,
                                         wait_first);
  }
}

cudaError_t LaunchGroupGemmFp8For(cudaStream_t stream, DType dtype, const void* x,
                                  const uint8_t* w, const float* w_scale, const int32_t* sizes,
                                  const int32_t* rows, int64_t topk, void* out,
                                  const GemmDims& d) {
  auto launch = [&]<DType DT>() {
    using S = Fp8Storage<DT>;
    GemmArgs a{};
    a.m = d.m;
    a.n = d.n;
    a.k = d.k;
    a.src = RowSource{rows, topk, d.x_rows * topk};
    a.vec_in = d.k % 16 == 0 && Aligned16(w);  // 16 codes a load
    a.vec_out = d.n % static_cast<int64_t>(16 / sizeof(S)) == 0 && Aligned16(out);
    const unsigned grid = Schedule(a, d.groups, kF8BM, kF8BN);
    return LaunchKernel(GroupGemmFp8Kernel<DT>, grid, kThreads, 0, stream, false,
                        static_cast<const S*>(x), w, w_scale, sizes, static_cast<S*>(out), a);
  };
  return WithFloatDType(dtype, launch);
}

cudaError_t LaunchGroupGemmFp8Skinny(cudaStream_t stream, DType dtype, const void* x,
                                     const uint8_t* w, const float* w_scale,
                                     const int32_t* sizes, const int32_t* rows, int64_t topk,
                                     void* out, const GemmDims& d, bool any_rows, bool* ran) {
  *ran = false;
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  const int64_t smem = Fp8DecodeSmem(d.groups, d.k);
  const int64_t smem_cap = std::min<int64_t>(kFp8DecodeMaxSmem, DeviceSmemOptin());
  if (d.m <= 0 || d.n <= 0 || (!any_rows && d.m > kFp8SkinnyMaxAvgRows * d.groups) ||
      !Fp8DecodeShapeOk(d.groups, d.k) || smem > smem_cap || !aligned(x) || !aligned(w))
    return cudaSuccess;
  *ran = true;  // from here on, the call is ours (errors are reported, not retried)
  auto launch = [&]<DType DT>() {
    using S = Fp8Storage<DT>;
    const auto kernel = GroupGemmFp8SkinnyKernel<DT>;
    cudaError_t err = EnsureDynamicSmem<GroupGemmFp8SkinnyKernel<DT>>(static_cast<int>(smem_cap));
    if (err != cudaSuccess) return err;
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFp8SkinnyThreads,
                                                        static_cast<size_t>(smem));
    if (err != cudaSuccess) return err;
    // Items: passes (at most ceil(m / rows) + the experts with rows) x column chunks.
    const int64_t chunks = (d.n + kFp8SkinnyCols - 1) / kFp8SkinnyCols;
    const int64_t passes =
        (d.m + kFp8SkinnyRows - 1) / kFp8SkinnyRows + std::min<int64_t>(d.m, d.groups);
    const int64_t grid = std::max<int64_t>(
        1, std::min<int64_t>(passes * chunks, static_cast<int64_t>(per_sm) * DeviceSms()));
    return LaunchKernel(kernel, static_cast<unsigned>(grid), kFp8SkinnyThreads,
                        static_cast<size_t>(smem), stream, false, static_cast<const S*>(x), w,
                        w_scale, sizes, rows, topk, d.x_rows * topk, static_cast<S*>(out), d.m,
                        d.n, d.k, d.groups);
  };
  return WithFloatDType(dtype, launch);
}

bool DeviceSupportsPdl() { return DeviceMajor() >= 9; }

}  // namespace jax_moe
