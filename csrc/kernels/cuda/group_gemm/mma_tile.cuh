// The grouped GEMM's tensor-core tiles (bf16 / f16, tile_m = 32, 64, 128):
// BM x 128 x 32 tiles, 8 warps of (BM/2) x 32, mma.sync m16n8k16 fed by
// ldmatrix with f32 accumulation, a 3-stage cp.async pipeline in dynamic
// shared memory. Part of the one translation unit of dispatch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"

namespace jax_moe {
namespace {

// ---------------------------------------------------------------------------
// bf16 / f16: tensor cores (mma.sync m16n8k16, f32 accumulate)
// ---------------------------------------------------------------------------
// mma.sync + ldmatrix rather than WMMA: WMMA's 16x16 fragments duplicate
// operands in registers, which pushed this tile past 200 registers (one block
// per SM); with the documented m16n8k16 layouts the kernel fits two blocks.

constexpr int kBK = 32;
constexpr int kStages = 3;
// Rows padded to 40 elements (80 bytes): 16-byte aligned for cp.async and
// ldmatrix, and the 8 row addresses of one 8x8 ldmatrix fall in 8 distinct
// 16-byte bank groups (conflict-free).
constexpr int kLds = kBK + 8;
constexpr int kRowChunks = kBK / 8;                    // 16-byte chunks per tile row
constexpr int kRowStep = kThreads / kRowChunks;         // rows one loader pass covers

// Shapes of the BM x BN tensor-core tile: 2 warps along M (BM/2 rows each,
// kMI m16 fragments), 4 along N (BN/4 columns each, kNI n8 fragments). The
// 128 x 256 tile gives each warp 64 x 64: twice the mma work per ldmatrix of
// the 64 x 32 warp tile (shared-memory bandwidth bound it at large M) and
// half the re-reads of x per output.
template <int BM, int BN>
struct MmaTile {
  static constexpr int kWM = BM / 2;
  static constexpr int kMI = kWM / 16;
  static constexpr int kWN = BN / 4;
  static constexpr int kNI = kWN / 8;
  static constexpr int kLdo = kWN + 8;        // epilogue staging row (16-byte multiple)
  static constexpr int kAElems = BM * kLds;   // one stage of x
  static constexpr int kBElems = BN * kLds;   // one stage of w
  static constexpr int kSmem = kStages * (kAElems + kBElems) * 2;
  static constexpr int kAPasses = (BM + kRowStep - 1) / kRowStep;
  static constexpr int kBPasses = BN / kRowStep;
  static constexpr int kMinBlocks = BN > 128 ? 1 : 2;  // 64x64 warp tiles need the registers
  static_assert(BM == 32 || BM == 64 || BM == 128, "tile_m");
  static_assert(BN == 128 || BN == 256, "tile_n");
  static_assert(kBPasses * kRowStep == BN && kRowChunks * kRowStep == kThreads, "loader");
  static_assert(kWarps * kWM * kLdo * 2 <= kSmem, "epilogue staging fits the pipeline buffers");
};

// Eight consecutive k of one row into shared memory. `src` points at the
// row's first element of this chunk, or is null for a row out of range; `rem`
// is how many elements of the row remain from there. cp.async only when all
// 16 bytes are in bounds and aligned; otherwise element-wise with zero fill.
__device__ __forceinline__ void LoadChunk16(uint16_t* dst, const uint16_t* src, int64_t rem,
                                            bool vec) {
  if (src != nullptr && rem > 0) {
    if (vec && rem >= 8) {
      CpAsync16(dst, src);
      return;
    }
    uint16_t v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = j < rem ? src[j] : uint16_t(0);
    *reinterpret_cast<uint4*>(dst) =
        make_uint4(Pack2(v[0], v[1]), Pack2(v[2], v[3]), Pack2(v[4], v[5]), Pack2(v[6], v[7]));
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int BM, int BN>
__device__ void GemmTile16(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                           uint16_t* __restrict__ out, const Tile& tile, const RowSource& src,
                           int64_t n0, int64_t n, int64_t k, bool vec_in, bool vec_out,
                           unsigned char* smem) {
  using C = MmaTile<BM, BN>;
  uint16_t* sa = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sb = sa + kStages * C::kAElems;
  const int64_t row0 = tile.row0, row_lim = tile.row_lim;
  const int64_t ktiles = CeilDiv(k, kBK);

  // Loader: thread owns rows lrow + kRowStep*it of both operands, columns
  // lcol..+7 of each k tile. Row pointers are fixed for the whole K loop;
  // A rows past BM (BM < kRowStep) have no slot at all.
  const int lrow = threadIdx.x / kRowChunks, lcol = (threadIdx.x % kRowChunks) * 8;
  const uint16_t* a_src[C::kAPasses];
  const uint16_t* b_src[C::kBPasses];
  {
#pragma unroll
    for (int it = 0; it < C::kAPasses; ++it) {
      const int64_t ar = row0 + lrow + it * kRowStep;
      const int64_t xr = ar < row_lim ? src.Row(ar) : -1;
      a_src[it] = xr >= 0 ? x + xr * k + lcol : nullptr;
    }
    const uint16_t* we = w + tile.expert * n * k;
#pragma unroll
    for (int it = 0; it < C::kBPasses; ++it) {
      const int64_t br = n0 + lrow + it * kRowStep;
      b_src[it] = br < n ? we + br * k + lcol : nullptr;
    }
  }
  auto load_stage = [&](int stage, int64_t kt) {
    const int64_t k0 = kt * kBK;
    const int64_t rem = k - k0 - lcol;
    uint16_t* da = sa + stage * C::kAElems + lrow * kLds + lcol;
    uint16_t* db = sb + stage * C::kBElems + lrow * kLds + lcol;
#pragma unroll
    for (int it = 0; it < C::kAPasses; ++it)
      if (BM % kRowStep == 0 || lrow + it * kRowStep < BM)
        LoadChunk16(da + it * kRowStep * kLds, a_src[it] ? a_src[it] + k0 : nullptr, rem, vec_in);
#pragma unroll
    for (int it = 0; it < C::kBPasses; ++it)
      LoadChunk16(db + it * kRowStep * kLds, b_src[it] ? b_src[it] + k0 : nullptr, rem, vec_in);
  };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp & 1;   // 2 warps along M: BM/2 rows each
  const int wn = warp >> 1;  // 4 warps along N: kWN columns each
  // ldmatrix row addresses. A (row-major 16x16): matrices (rows 0-7|8-15) x
  // (k 0-7|8-15) give a0..a3 of m16n8k16. B is stored n-major (w is N x K),
  // which is exactly the "col" operand: matrices (k 0-7, k 8-15) of n 0-7,
  // then of n 8-15, give {b0, b1} of two n8 tiles.
  const int a_off = (wm * C::kWM + (lane & 15)) * kLds + (lane >> 4) * 8;
  const int b_off = (wn * C::kWN + (lane & 7) + ((lane >> 4) << 3)) * kLds + ((lane >> 3) & 1) * 8;

  float acc[C::kMI][C::kNI][4];
#pragma unroll
  for (int i = 0; i < C::kMI; ++i)
#pragma unroll
    for (int j = 0; j < C::kNI; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  // Prologue: kStages - 1 tiles in flight. Empty groups are committed too so
  // the wait_group count stays right at the end of K.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    CpAsyncCommit();
  }
  // Ring indices kept as ints (a 64-bit modulo per k tile is not free).
  int stage = 0, next_stage = kStages - 1;
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    CpAsyncWait<kStages - 2>();  // this thread's copies of tile kt landed
    __syncthreads();             // everyone's have; stage (kt-1) % kStages is free
    if (kt + kStages - 1 < ktiles) load_stage(next_stage, kt + kStages - 1);
    CpAsyncCommit();
    next_stage = next_stage == kStages - 1 ? 0 : next_stage + 1;

    const uint16_t* ta = sa + stage * C::kAElems + a_off;
    const uint16_t* tb = sb + stage * C::kBElems + b_off;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t bf[C::kNI / 2][4];  // bf[p] = {b0, b1} of n8 tile 2p, then of 2p+1
#pragma unroll
      for (int p = 0; p < C::kNI / 2; ++p) Ldmatrix4(bf[p], tb + p * 16 * kLds + kk);
#pragma unroll
      for (int i = 0; i < C::kMI; ++i) {
        uint32_t af[4];
        Ldmatrix4(af, ta + i * 16 * kLds + kk);
#pragma unroll
        for (int j = 0; j < C::kNI; ++j)
          Mma16816<T>(acc[i][j], af, bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
      }
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  CpAsyncWait<0>();
  __syncthreads();  // the staging below reuses the pipeline buffers

  // Epilogue: round to the output type into a per-warp staging tile (lane
  // holds rows g, g+8 and columns 2t, 2t+1 of each 16x8 accumulator), then
  // write whole 16-byte row pieces to global memory.
  uint16_t* st = reinterpret_cast<uint16_t*>(smem) + warp * C::kWM * C::kLdo;
  {
    const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < C::kMI; ++i)
#pragma unroll
      for (int j = 0; j < C::kNI; ++j) {
        uint16_t* p = st + (i * 16 + g) * C::kLdo + j * 8 + t2;
        *reinterpret_cast<uint32_t*>(p) =
            Pack2(FromFloat16<T>(acc[i][j][0]), FromFloat16<T>(acc[i][j][1]));
        *reinterpret_cast<uint32_t*>(p + 8 * C::kLdo) =
            Pack2(FromFloat16<T>(acc[i][j][2]), FromFloat16<T>(acc[i][j][3]));
      }
  }
  __syncwarp();
  constexpr int kPieces = C::kWN / 8;  // 16-byte pieces per staged row
#pragma unroll
  for (int q = lane; q < C::kWM * kPieces; q += 32) {
    const int r = q / kPieces, c = (q % kPieces) * 8;
    const int64_t grow = row0 + wm * C::kWM + r;
    const int64_t gcol = n0 + wn * C::kWN + c;
    if (grow < row_lim && gcol < n) {
      const uint16_t* s = st + r * C::kLdo + c;
      uint16_t* dst = out + grow * n + gcol;
      if (vec_out && gcol + 8 <= n) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(s);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (gcol + e < n) dst[e] = s[e];
      }
    }
  }
  __syncthreads();  // staging aliases stage 0 of the next grid-stride tile
}

// Two blocks per SM for 128-column tiles (<= 128 registers, 2 x <= 60 KB
// shared memory), one for 256-column tiles (64x64 warp tiles, 92 KB).
template <typename T, int BM, int BN>
__global__ void __launch_bounds__(kThreads, MmaTile<BM, BN>::kMinBlocks)
    GroupGemm16Kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                      const int32_t* __restrict__ sizes, uint16_t* __restrict__ out,
                      GemmArgs a) {
  extern __shared__ __align__(128) unsigned char smem16[];
  PdlStart(a);
  ForEachTile<BM, BN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    PdlWait();  // x may be the previous kernel's output
    GemmTile16<T, BM, BN>(x, w, out, tile, a.src, n0, a.n, a.k, a.vec_in, a.vec_out, smem16);
  });
  PdlWait();  // a block without tiles too: this grid ends after its primary
}

// One launch of the BM x BN tile kernel (opting in to its dynamic shared
// memory first).
template <typename T, int BM, int BN>
cudaError_t LaunchMma(cudaStream_t stream, const uint16_t* x, const uint16_t* w,
                      const int32_t* sizes, uint16_t* out, GemmArgs a, int64_t groups,
                      bool pdl) {
  const cudaError_t attr =
      EnsureDynamicSmem<GroupGemm16Kernel<T, BM, BN>>(MmaTile<BM, BN>::kSmem);
  if (attr != cudaSuccess) return attr;
  const unsigned grid = Schedule(a, groups, BM, BN);
  return LaunchKernel(GroupGemm16Kernel<T, BM, BN>, grid, kThreads, MmaTile<BM, BN>::kSmem,
                      stream, pdl, x, w, sizes, out, a);
}

}  // namespace
}  // namespace jax_moe
