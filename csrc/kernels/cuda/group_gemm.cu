// Steps 4 and 6 on the GPU: out[rows of group e] = x[rows of e] @ w[e]^T with
// f32 accumulation; rows past sum(expert_sizes) are zero. Same semantics as
// csrc/cpu/group_gemm.cc: negative sizes count as 0 and groups are clamped to M.
//
// Design
//  * One launch, no host sync: the grid has an upper bound of "m-slots"
//    (min(ceil(M/BM) + E, M) + 1 >= sum_e ceil(rows_e/BM) + 1) times ceil(N/BN) column
//    tiles. Every block recomputes the per-expert tile schedule from
//    expert_sizes on the device (a block-wide prefix scan, 1024 experts per
//    pass) and finds the (expert, row tile) its m-slot owns. Slots past the
//    last tile are "spare": together they zero the tail rows [sum, M).
//  * The grid is 1-D and grouped: kGroupM m-slots walk the column tiles
//    together so that the blocks in flight share x row tiles and w[e] column
//    tiles in L2 (a plain 2-D grid would stream all of x once per column tile).
//    A grid-stride loop over the linear block id removes every grid-size limit.
//  * bf16/f16: tensor cores (mma.sync m16n8k16 fed by ldmatrix), f32
//    accumulate. BMx128x32 tiles with BM = 32, 64 or 128 (the caller's tile_m:
//    a few rows per expert would waste most of a 128-row tile), 8 warps of
//    (BM/2)x32, a 3-stage cp.async pipeline in dynamic shared memory.
//  * bf16/f16 with tile_m = 8 (decode: a handful of rows per expert): the
//    "skinny" kernel streams each expert's weights once with 16-byte loads
//    straight into mma registers (swap-AB: weight rows are the mma's M side,
//    the <= 8 token rows its N side), K split over 8 warps and summed in a
//    fixed order. Needs K % 8 == 0 and 16-byte aligned x and w; otherwise
//    the BM = 32 kernel runs instead. Large decode launches run it
//    persistent: one resident grid that scans the schedule once per block
//    into shared memory and walks only the real tiles (no per-tile scan, no
//    spare blocks): up to 14% more weight bandwidth at 16-128 tokens on the
//    H200 (benchmarks/RESULTS.md, fifth session). Both forms sum K in the
//    same order, so they give the same bits.
//  * bf16/f16 with tile_m = 16 on compute capability 9.0+ (decode, 2-128
//    tokens): the TMA kernel, persistent and warp-specialised: a producer
//    warp streams 128 weight rows x 64 k per stage with the tensor memory
//    accelerator, eight consumer warps multiply them by up to 16 token rows.
//    4.2-4.35 TB/s of weights on the H200 where the skinny kernel reached
//    3.4-4.1 (benchmarks/RESULTS.md, sixth session). Launches of fewer than
//    6 tiles per SM (1.5 from K = 8192), and everything it cannot take, run
//    tile 8.
//  * Fused gather (step 3): with `gather`, row r of the GEMM input is
//    x[rows[r] / topk] (zero where rows[r] is outside [0, x_rows * topk)),
//    read in the A-load, so the expanded copy of x is never written.
//  * f32: exact-f32 SIMT FMA (no TF32): 128x128x8 tiles, 8x8 outputs per
//    thread, operands transposed into shared memory, register prefetch of the
//    next k tile.
//  * Edges: 16-byte loads/stores only where the row is 16-byte aligned and the
//    whole vector is in bounds; everything else goes element by element with
//    zero fill, so any M, N, K (odd ones too) is safe.
//  * tile_m = 256 asks for the Hopper kernel (group_gemm_sm90.cu, CUTLASS
//    wgmma + TMA, built when JAX_MOE_WITH_SM90): used when it applies (a
//    compute capability 9.0 device, bf16/f16, N and K multiples of 8, the
//    scratch output sized for it), else the 128-row tile runs instead: the
//    same results up to the order of the K sums.
#include <cuda.h>  // CUtensorMap (types only: the encoder comes through the runtime)
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm.cuh"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"
#include "ffi/shape_checks.h"
#ifdef JAX_MOE_WITH_SM90
#include "kernels/cuda/group_gemm_sm90.h"
#endif

namespace jax_moe {
namespace {

constexpr int kThreads = 256;  // 8 warps, every kernel
constexpr int kWarps = kThreads / 32;
constexpr int kBN = 128;       // columns of out per tile (tensor-core and f32 kernels)
constexpr int kBMf = 128;      // rows per tile of the f32 kernel
constexpr int kGroupM = 8;     // m-slots per raster group (L2 reuse)
constexpr int kScanPer = 4;    // experts per thread per schedule pass
constexpr int64_t kMaxGrid = 2147483647;

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------
// Tile schedule (shared by both kernels)
// ---------------------------------------------------------------------------

// What one m-slot owns: rows [row0, row_lim) of expert `expert`, or, when
// expert < 0, nothing but its share of the tail [rows_total, M).
struct Tile {
  int64_t expert;
  int64_t row0;
  int64_t row_lim;      // min(row0 + BM, end of the expert's rows)
  int64_t tiles_total;  // valid when expert < 0: number of real tiles
  int64_t rows_total;   // valid when expert < 0: min(sum of sizes, M)
};

// Inclusive block-wide scan; *total gets the sum over the block. Contains one
// __syncthreads; the caller keeps `warp_sums` untouched until the next barrier.
template <int Warps = kWarps>
__device__ __forceinline__ int64_t BlockInclusiveScan(int64_t v, int64_t* warp_sums,
                                                      int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpInclusiveSum(v);
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int64_t before = 0, all = 0;
#pragma unroll
  for (int i = 0; i < Warps; ++i) {
    const int64_t s = warp_sums[i];
    before += i < warp ? s : 0;
    all += s;
  }
  *total = all;
  return v + before;
}

// Expert e owns rows [min(P_e, M), min(P_{e+1}, M)) with P_e the prefix sum of
// max(size, 0): exactly the CPU loop's clamping. Its tiles are numbered from
// the prefix sum of ceil(rows/BM). Must be called by the whole block.
template <int BM>
__device__ Tile FindTile(const int32_t* __restrict__ sizes, int64_t num_experts, int64_t m,
                         int64_t slot) {
  __shared__ int64_t s_rows[kWarps], s_tiles[kWarps];
  __shared__ int64_t s_found[3];  // expert, row0, row_lim
  __syncthreads();  // the previous grid-stride iteration may still read s_found
  if (threadIdx.x == 0) s_found[0] = -1;
  int64_t row_carry = 0, tile_carry = 0;  // block-uniform
  for (int64_t base = 0; base < num_experts; base += kThreads * kScanPer) {
    const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kScanPer;
    int64_t cnt[kScanPer];
    int64_t local = 0;
#pragma unroll
    for (int i = 0; i < kScanPer; ++i) {
      const int64_t e = first + i;
      const int32_t s = e < num_experts ? sizes[e] : 0;
      cnt[i] = s > 0 ? s : 0;
      local += cnt[i];
    }
    int64_t rows_chunk;
    const int64_t rows_before = row_carry + BlockInclusiveScan(local, s_rows, &rows_chunk) - local;
    int64_t p = rows_before, tiles_local = 0;
#pragma unroll
    for (int i = 0; i < kScanPer; ++i) {
      const int64_t st = Min64(p, m);
      p += cnt[i];
      tiles_local += CeilDiv(Min64(p, m) - st, BM);
    }
    int64_t tiles_chunk;
    const int64_t tiles_before =
        tile_carry + BlockInclusiveScan(tiles_local, s_tiles, &tiles_chunk) - tiles_local;
    if (slot >= tiles_before && slot < tiles_before + tiles_local) {  // one thread at most
      p = rows_before;
      int64_t t = tiles_before;
      bool done = false;
#pragma unroll
      for (int i = 0; i < kScanPer; ++i) {
        const int64_t st = Min64(p, m);
        p += cnt[i];
        const int64_t en = Min64(p, m);
        const int64_t n = CeilDiv(en - st, BM);
        if (!done && slot < t + n) {
          const int64_t row0 = st + (slot - t) * BM;
          s_found[0] = first + i;
          s_found[1] = row0;
          s_found[2] = Min64(row0 + BM, en);
          done = true;
        }
        t += n;
      }
    }
    // Clamping the carry to M is exact (min(min(a, M) + b, M) == min(a + b, M)
    // for b >= 0) and keeps it from growing over many passes.
    row_carry = Min64(row_carry + rows_chunk, m);
    tile_carry += tiles_chunk;
    __syncthreads();
    // Uniform exit: found, or every row placed (later experts own no tiles).
    if (s_found[0] >= 0 || row_carry >= m) break;
  }
  __syncthreads();  // s_found[0] = -1 is visible even when the loop never ran
  Tile tile;
  tile.expert = s_found[0];
  tile.row0 = s_found[1];
  tile.row_lim = s_found[2];
  tile.tiles_total = tile_carry;
  tile.rows_total = row_carry;
  return tile;
}

// Linear block id -> (m-slot, column tile), kGroupM m-slots per group walking
// the column tiles together.
__device__ __forceinline__ void DecodeBlock(int64_t id, int64_t mslots, int64_t ntiles,
                                            int64_t* mslot, int64_t* ntile) {
  const int64_t per_group = static_cast<int64_t>(kGroupM) * ntiles;
  const int64_t g = id / per_group;
  const int64_t local = id - g * per_group;
  const int64_t gm = Min64(kGroupM, mslots - g * kGroupM);  // last group may be short
  *mslot = g * kGroupM + local % gm;
  *ntile = local / gm;
}

// Spare slot: zero rows [rows_total, M) of this BN-column tile, striding by
// BM-row blocks over all spare slots so each tail row is written exactly once
// per column tile. With `vec` (N a multiple of 16 bytes' worth of elements and
// out 16-byte aligned) every row piece starts aligned and is a whole number of
// 16-byte vectors, so the stores are uint4.
template <typename S, int BM, int BN>
__device__ void ZeroTail(S* __restrict__ out, const Tile& tile, int64_t mslot, int64_t mslots,
                         int64_t n0, int64_t n, int64_t m, bool vec) {
  const int64_t spare = mslot - tile.tiles_total;    // >= 0
  const int64_t nspare = mslots - tile.tiles_total;  // >= 1 (grid has a spare slot)
  const int cols = static_cast<int>(Min64(BN, n - n0));
  // Vector width in elements: 16 bytes when `vec`, else one element.
  const int width = vec ? static_cast<int>(16 / sizeof(S)) : 1;
  const int per_row = (cols + width - 1) / width;  // exact when vec
  const int row_slots = (BN + width - 1) / width;
  for (int64_t r0 = tile.rows_total + spare * BM; r0 < m; r0 += nspare * BM) {
    for (int i = threadIdx.x; i < BM * row_slots; i += kThreads) {
      const int64_t r = r0 + i / row_slots;
      const int c = i % row_slots;
      if (r >= m || c >= per_row) continue;
      S* dst = out + r * n + n0 + c * width;
      if (vec) *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      else *dst = S(0);
    }
  }
}

// Grid size for `mslots` m-slots of BM rows: sum_e ceil(rows_e / BM) is at
// most ceil(M / BM) + E and at most M (a non-empty expert's tiles never
// outnumber its rows), so one more slot than the smaller bound is spare and
// zeroes the tail. The M bound keeps decode grids small when E >> M.
inline int64_t MSlots(int64_t m, int64_t bm, int64_t groups) {
  const int64_t by_tiles = (m + bm - 1) / bm + groups;
  return (by_tiles < m ? by_tiles : m) + 1;
}

// Where row r of the GEMM input lives: x + r * k, or with a gather the token
// row rows[r] / topk, or null (a zero row) when that index is out of range.
struct RowSource {
  const int32_t* rows;  // null: no gather
  int64_t topk;
  int64_t limit;        // x_rows * topk: valid gather entries are [0, limit)
  __device__ __forceinline__ int64_t Row(int64_t r) const {
    return rows == nullptr ? r : ExpandSourceRow(rows[r], topk, limit);
  }
};

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

// Everything one launch needs besides the pointers.
struct GemmArgs {
  int64_t m, n, k, num_experts, mslots, ntiles, total_blocks;
  bool vec_in, vec_out;
  bool wait_first;  // launched with PDL after the kernel that wrote expert_sizes and rows
  RowSource src;
};

// Every GEMM kernel's first statement. Launched with PDL, a kernel lets the
// next one start at once and waits for the previous one only before it reads
// x: its tile schedule (expert_sizes, rows) and first weights come first.
// With wait_first (moe_layer's w13 GEMM, after the token index) the schedule
// is the previous kernel's output too: wait first, and let the next kernel
// start only then, so that it can read expert_sizes before its own wait.
__device__ __forceinline__ void PdlStart(const GemmArgs& a) {
  if (a.wait_first) PdlWait();
  PdlTrigger();
}

// The grid-stride loop of every GEMM kernel: block id -> (m-slot, column
// tile), the m-slot's tile from the schedule, then either the tail zeroing
// (spare slot) or fn(tile, n0) for a real tile.
template <int BM, int BN, typename S, typename TileFn>
__device__ __forceinline__ void ForEachTile(const GemmArgs& a, const int32_t* __restrict__ sizes,
                                            S* __restrict__ out, TileFn&& fn) {
  for (int64_t id = blockIdx.x; id < a.total_blocks; id += gridDim.x) {
    int64_t mslot, ntile;
    DecodeBlock(id, a.mslots, a.ntiles, &mslot, &ntile);
    const Tile tile = FindTile<BM>(sizes, a.num_experts, a.m, mslot);
    const int64_t n0 = ntile * BN;
    if (tile.expert < 0) {
      ZeroTail<S, BM, BN>(out, tile, mslot, a.mslots, n0, a.n, a.m, a.vec_out);
    } else {
      fn(tile, n0);
    }
  }
}

// The persistent forms scan the schedule once per block into shared memory
// (experts <= kPersistMaxE, M < 2^31): the first tile and first row of every
// expert, from which any tile id decodes without another scan.
constexpr int kPersistMaxE = 1024;
// Whether a problem of `experts` experts and m rows fits that schedule.
inline bool PersistScheduleFits(int64_t experts, int64_t m) {
  return experts <= kPersistMaxE && m < (int64_t{1} << 31);
}
struct PersistSchedule {
  int tile0[kPersistMaxE + 1];  // first m-tile of expert e; [E] = all tiles
  int row0[kPersistMaxE + 1];   // first row of expert e, clamped to M
  int64_t tiles, rows;          // real m-tiles; rows placed, min(sum of sizes, M)
};

// Fills `sch` (shared) from `sizes`; the whole block (Warps warps) calls it.
template <int BM, int Warps>
__device__ void ScanSchedule(const GemmArgs& a, const int32_t* __restrict__ sizes,
                             PersistSchedule& sch, int64_t* s_sums) {
  const int num_e = static_cast<int>(a.num_experts);
  int64_t rows = 0, tiles = 0;  // block-uniform carries, as in FindTile
  if (threadIdx.x == 0) sch.tile0[0] = sch.row0[0] = 0;
  for (int base = 0; base < num_e; base += Warps * 32) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int32_t sz = e < num_e ? sizes[e] : 0;
    const int64_t cnt = sz > 0 ? sz : 0;
    int64_t rows_chunk, tiles_chunk;
    const int64_t incl = BlockInclusiveScan<Warps>(cnt, s_sums, &rows_chunk);
    const int64_t st = Min64(rows + incl - cnt, a.m), en = Min64(rows + incl, a.m);
    const int64_t nt = CeilDiv(en - st, BM);
    __syncthreads();  // s_sums is read by every thread before the next scan writes it
    const int64_t tincl = BlockInclusiveScan<Warps>(nt, s_sums, &tiles_chunk);
    if (e < num_e) {
      sch.row0[e + 1] = static_cast<int>(en);
      sch.tile0[e + 1] = static_cast<int>(tiles + tincl);
    }
    rows = Min64(rows + rows_chunk, a.m);
    tiles += tiles_chunk;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    sch.tiles = tiles;
    sch.rows = rows;
  }
  __syncthreads();  // everything above is visible even when E == 0
}

// The tile of m-slot `mslot` (< sch.tiles): the owner is the last expert whose
// first tile is <= mslot (empty experts before it share its first tile; those
// after start later).
template <int BM>
__device__ __forceinline__ Tile PersistTile(const PersistSchedule& sch, int num_e,
                                            int64_t mslot) {
  int lo = 0, hi = num_e - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (sch.tile0[mid] <= mslot) lo = mid;
    else hi = mid - 1;
  }
  Tile tile{};
  tile.expert = lo;
  tile.row0 = sch.row0[lo] + (mslot - sch.tile0[lo]) * BM;
  tile.row_lim = Min64(tile.row0 + BM, sch.row0[lo + 1]);
  return tile;
}

// Tail chunk j of the persistent forms: rows [rows + (j / ntiles) * BM, +BM)
// of column tile j % ntiles, zeroed element-wise by `nthreads` threads from
// thread `tid` (the tail is empty unless sum(expert_sizes) < M).
template <int BM, int BN, typename S>
__device__ __forceinline__ void ZeroTailChunk(S* __restrict__ out, const GemmArgs& a,
                                              int64_t rows, int64_t j, int tid, int nthreads) {
  const int64_t r0 = rows + (j / a.ntiles) * BM, n0 = (j % a.ntiles) * BN;
  for (int i = tid; i < BM * BN; i += nthreads) {
    const int64_t r = r0 + i / BN, c = n0 + i % BN;
    if (r < a.m && c < a.n) out[r * a.n + c] = S(0);
  }
}

// The persistent loop: after the scan each block strides over the real tiles
// only, in the same grouped raster as ForEachTile, then over the BM-row
// chunks of the tail [rows, M), which it zeroes.
template <int BM, int BN, typename S, typename TileFn>
__device__ __forceinline__ void ForEachTilePersistent(const GemmArgs& a,
                                                      const int32_t* __restrict__ sizes,
                                                      S* __restrict__ out, TileFn&& fn) {
  __shared__ PersistSchedule sch;
  __shared__ int64_t s_sums[kWarps];
  ScanSchedule<BM, kWarps>(a, sizes, sch, s_sums);
  const int64_t real = sch.tiles * a.ntiles;
  const int64_t total = real + CeilDiv(a.m - sch.rows, BM) * a.ntiles;
  for (int64_t id = blockIdx.x; id < total; id += gridDim.x) {
    if (id < real) {
      int64_t mslot, ntile;
      DecodeBlock(id, sch.tiles, a.ntiles, &mslot, &ntile);
      fn(PersistTile<BM>(sch, static_cast<int>(a.num_experts), mslot), ntile * BN);
    } else {
      ZeroTailChunk<BM, BN>(out, a, sch.rows, id - real, threadIdx.x, kThreads);
    }
  }
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

// ---------------------------------------------------------------------------
// bf16 / f16 decode: the skinny kernel (tile_m = 8)
// ---------------------------------------------------------------------------
// One block = (expert tile of <= 8 rows) x 32 columns. Warp w: k steps w,
// w+8, ... of 32 elements for all 32 columns (two m16 groups): splitting K 8
// ways keeps each warp's chain of dependent loads short (decode latency).
// Within a k step lane (g, t) = (lane/4, lane%4) loads 16 bytes at k + 8t of
// weight rows g and g+8 of each group and of token row g. The mma's k order
// is a permutation of the actual one, the same for both operands: a0/b0 take
// elements 8t+0..1, a2/b1 elements 8t+2..3 (first mma), then 8t+4..7 (second).

constexpr int kSR = 8;     // token rows per tile (the mma's n)
constexpr int kSBN = 32;   // columns per block
constexpr int kSKW = kWarps;  // warps splitting K
constexpr int kSKStep = 32;
static_assert(32 * kSKW == kThreads, "skinny warp layout");

// KT: k steps per trip of the load loop (KT x 5 16-byte loads in flight per lane).
// before_x() runs once per warp between its first trip's weight loads and its
// first token-row loads: a kernel launched with PDL waits there for the kernel
// that writes x, with its first weights already in flight.
template <typename T, int KT, typename BeforeX>
__device__ void SkinnyTile(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                           uint16_t* __restrict__ out, const Tile& tile, const RowSource& src,
                           int64_t n0, int64_t n, int64_t k, BeforeX&& before_x) {
  __shared__ float red[kSKW][kSBN][kSR];
  const int wk = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t ksteps = CeilDiv(k, kSKStep);

  // Token row g of the tile (null: past the tile or a zero row).
  const int64_t ar = tile.row0 + g;
  const int64_t xr = ar < tile.row_lim ? src.Row(ar) : -1;
  const uint16_t* xrow = xr >= 0 ? x + xr * k + 8 * t : nullptr;
  // Weight rows g and g+8 of both m16 groups (null: past N).
  const uint16_t* wrow[4];
  const uint16_t* we = w + tile.expert * n * k;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = n0 + (j >> 1) * 16 + (j & 1) * 8 + g;
    wrow[j] = c < n ? we + c * k + 8 * t : nullptr;
  }

  float acc[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[i][q] = 0.f;

  // K % 8 == 0: a lane's 16-byte chunk of k step s is whole or past K.
  auto kin = [&](int64_t s) { return s < ksteps && s * kSKStep + 8 * t < k; };
  auto load_w = [&](int64_t s, uint4 (&wv)[4]) {
    const bool in = kin(s);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wv[j] = in && wrow[j] ? LdgStream(wrow[j] + s * kSKStep) : make_uint4(0, 0, 0, 0);
  };
  auto load_x = [&](int64_t s, uint4& xa) {
    xa = kin(s) && xrow ? __ldg(reinterpret_cast<const uint4*>(xrow + s * kSKStep))
                        : make_uint4(0, 0, 0, 0);
  };
  auto math = [&](const uint4& xa, const uint4 (&wv)[4]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4& lo = wv[2 * i];
      const uint4& hi = wv[2 * i + 1];
      const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
      const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
      Mma16816<T>(acc[i], a0, xa.x, xa.y);
      Mma16816<T>(acc[i], a1, xa.z, xa.w);
    }
  };
  bool first = true;
  for (int64_t s = wk; s < ksteps; s += KT * kSKW) {
    uint4 xa[KT], wv[KT][4];
#pragma unroll
    for (int q = 0; q < KT; ++q) load_w(s + q * kSKW, wv[q]);
    if (first) {
      before_x();
      first = false;
    }
#pragma unroll
    for (int q = 0; q < KT; ++q) load_x(s + q * kSKW, xa[q]);
#pragma unroll
    for (int q = 0; q < KT; ++q) math(xa[q], wv[q]);
  }

  // acc[i] = {(col g, row 2t), (col g, row 2t+1), (col g+8, row 2t), (col g+8, row 2t+1)}
  // of group i. Sum the K slices in slice order.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = i * 16 + g;
    red[wk][c][2 * t] = acc[i][0];
    red[wk][c][2 * t + 1] = acc[i][1];
    red[wk][c + 8][2 * t] = acc[i][2];
    red[wk][c + 8][2 * t + 1] = acc[i][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kSR * kSBN; i += kThreads) {
    const int r = i / kSBN, c = i % kSBN;  // consecutive threads: consecutive columns
    const int64_t grow = tile.row0 + r, gcol = n0 + c;
    if (grow < tile.row_lim && gcol < n) {
      float v = red[0][c][r];
#pragma unroll
      for (int q = 1; q < kSKW; ++q) v += red[q][c][r];
      out[grow * n + gcol] = FromFloat16<T>(v);
    }
  }
  __syncthreads();  // red is reused by the next grid-stride tile
}

// A block per tile (small launches: hardware scheduling fills the SMs best
// when there are only a few waves), two k steps per trip, 3 blocks per SM.
template <typename T>
__global__ void __launch_bounds__(kThreads, 3)
    GroupGemmSkinnyKernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                          const int32_t* __restrict__ sizes, uint16_t* __restrict__ out,
                          GemmArgs a) {
  PdlStart(a);
  ForEachTile<kSR, kSBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    SkinnyTile<T, 2>(x, w, out, tile, a.src, n0, a.n, a.k, [] { PdlWait(); });
  });
  PdlWait();  // a block without tiles too: this grid ends after its primary
}

// Persistent (large launches): 4 blocks per SM of one k step per trip kept
// the most loads in flight in the H200 measurements (64 registers).
template <typename T>
__global__ void __launch_bounds__(kThreads, 4)
    GroupGemmSkinnyPersistentKernel(const uint16_t* __restrict__ x,
                                    const uint16_t* __restrict__ w,
                                    const int32_t* __restrict__ sizes,
                                    uint16_t* __restrict__ out, GemmArgs a) {
  PdlStart(a);
  ForEachTilePersistent<kSR, kSBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    SkinnyTile<T, 1>(x, w, out, tile, a.src, n0, a.n, a.k, [] { PdlWait(); });
  });
  PdlWait();  // a block without tiles too: this grid ends after its primary
}

// ---------------------------------------------------------------------------
// bf16 / f16 decode on Hopper (compute capability 9.0+): the TMA kernel
// ---------------------------------------------------------------------------
// Persistent and warp-specialised. A producer warp streams each tile's weight
// rows (16 x Consumers of them: the out columns) in boxes of 64 k with the
// tensor memory accelerator (one instruction per box, 128-byte swizzle, bytes
// counted on the stage's mbarrier: no registers hold loads in flight, and
// the ring runs on across tile boundaries) and its <= 16 token rows with
// cp.async (16 bytes per lane, zero-filled past K, past the tile and for zero
// rows; the gather index is applied here). Consumer warp c multiplies weight
// rows 16c..16c+15 by the token rows (mma.sync fed by ldmatrix) and frees the
// stage. Up to 16 token rows per tile: an expert with 9-16 rows reads its
// weights once (the 8-row skinny tile reads them twice). Each output is summed
// over all of K by one warp in k order: deterministic.
// What stays stale in a stage is never used: weight rows past N feed only
// columns that are not stored, and k steps past K are skipped (the box that
// holds K's end is zero-filled beyond it by the TMA, the token rows by cp.async).
template <int Consumers, int Stages, int KB>
struct TmaCfg {
  static constexpr int kRows = 16;                  // token rows per tile
  static constexpr int kCols = 16 * Consumers;      // weight rows (out columns) = TMA box rows
  static constexpr int kKC = 64 * KB;               // k per stage: KB boxes of 64
  static constexpr int kBoxBytes = kCols * 128;     // one 64-k box: 128-byte swizzled rows
  static constexpr int kXPitch = kKC * 2 + 16;      // token row: an odd number of 16-byte chunks
  static constexpr int kXOff = KB * kBoxBytes;      // token rows after the boxes
  static constexpr int kStageBytes = (kXOff + kRows * kXPitch + 1023) / 1024 * 1024;
  static constexpr int kSmem = Stages * kStageBytes + 1024;  // + alignment slack (128B swizzle)
  static constexpr int kThreads = (Consumers + 1) * 32;
  static constexpr int kXChunks = kRows * kKC / 8;  // 16-byte token chunks per stage
  static_assert(kXChunks % 32 == 0 && kBoxBytes % 1024 == 0 && kCols <= 256, "tma tile");
};

template <typename T, int Consumers, int Stages, int KB>
__global__ void __launch_bounds__(TmaCfg<Consumers, Stages, KB>::kThreads)
    GroupGemmTmaKernel(const __grid_constant__ CUtensorMap wmap, const uint16_t* __restrict__ x,
                       const int32_t* __restrict__ sizes, uint16_t* __restrict__ out,
                       GemmArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using C = TmaCfg<Consumers, Stages, KB>;
  extern __shared__ unsigned char smem_raw[];
  // 128-byte swizzled boxes repeat every 1024 bytes: align the ring to that.
  unsigned char* ring = smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
  __shared__ uint64_t full[Stages], empty[Stages];
  __shared__ PersistSchedule sch;
  __shared__ int64_t s_sums[Consumers + 1];
  PdlStart(a);
  ScanSchedule<C::kRows, Consumers + 1>(a, sizes, sch, s_sums);
  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      MbarInit(&full[s], 1 + 32);      // the producer's expect_tx + its 32 lanes' cp.async
      MbarInit(&empty[s], Consumers * 32);  // every consumer thread arrives
    }
    FenceMbarInit();
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int num_e = static_cast<int>(a.num_experts);
  const int64_t real = sch.tiles * a.ntiles;
  const int64_t ksteps = CeilDiv(a.k, C::kKC);
  int stage = 0;
  unsigned phase = 0;
  auto advance = [&] {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  if (warp == Consumers) {  // producer
    const uint64_t policy = L2EvictFirst();
    auto tile_wrow = [&](int64_t id, Tile* tile) {  // the tile of `id`, its first weight row
      int64_t mslot, ntile;
      DecodeBlock(id, sch.tiles, a.ntiles, &mslot, &ntile);
      *tile = PersistTile<C::kRows>(sch, num_e, mslot);
      return static_cast<int>(tile->expert * a.n + ntile * C::kCols);
    };
    auto issue_w = [&](int st_idx, int64_t k0, int wrow) {  // lane 0: one stage's weight boxes
      const int boxes = static_cast<int>(Min64(KB, CeilDiv(a.k - k0, 64)));
      MbarArriveExpectTx(&full[st_idx], boxes * C::kBoxBytes);
      for (int b = 0; b < boxes; ++b)
        TmaLoad2D(ring + st_idx * C::kStageBytes + b * C::kBoxBytes, &wmap,
                  static_cast<int>(k0) + 64 * b, wrow, &full[st_idx], policy);
    };
    // The first tile's first stages of weights go out before the wait for
    // the kernel that writes x (launched with PDL, this block may start while
    // it runs); the ring starts empty, so stage s holds k step s.
    int64_t ahead = 0;
    if (blockIdx.x < real) {
      Tile first;
      const int wrow = tile_wrow(blockIdx.x, &first);
      ahead = Min64(Stages, ksteps);
      if (lane == 0)
        for (int s = 0; s < ahead; ++s) issue_w(s, s * C::kKC, wrow);
    }
    PdlWait();  // x may be the previous kernel's output
    for (int64_t id = blockIdx.x; id < real; id += gridDim.x) {
      Tile tile;
      const int wrow = tile_wrow(id, &tile);
      // Token chunks of this lane: chunk q = lane + 32 i is row q / (kKC/8),
      // 16-byte column q % (kKC/8); rows past the tile and zero rows read nothing.
      const uint16_t* xsrc[C::kXChunks / 32];
      int xoff[C::kXChunks / 32];
#pragma unroll
      for (int i = 0; i < C::kXChunks / 32; ++i) {
        const int q = lane + 32 * i, r = q / (C::kKC / 8), c = q % (C::kKC / 8);
        const int64_t ar = tile.row0 + r;
        const int64_t xr = ar < tile.row_lim ? a.src.Row(ar) : -1;
        xsrc[i] = xr >= 0 ? x + xr * a.k + c * 8 : nullptr;
        xoff[i] = C::kXOff + r * C::kXPitch + c * 16;
      }
      for (int64_t ks = 0; ks < ksteps; ++ks) {
        const int64_t k0 = ks * C::kKC;
        MbarWait(&empty[stage], phase ^ 1u);  // the first round passes: the ring starts empty
        unsigned char* st = ring + stage * C::kStageBytes;
        if (ahead > 0) --ahead;  // issued before the wait
        else if (lane == 0) issue_w(stage, k0, wrow);
#pragma unroll
        for (int i = 0; i < C::kXChunks / 32; ++i) {
          const int64_t kk = k0 + (lane + 32 * i) % (C::kKC / 8) * 8;
          const bool in = xsrc[i] != nullptr && kk < a.k;  // K % 8 == 0: whole chunk or none
          CpAsync16Zfill(st + xoff[i], in ? xsrc[i] + k0 : x, in ? 16 : 0);
        }
        CpAsyncArriveNoinc(&full[stage]);
        advance();
      }
    }
    return;
  }
  // Consumers. ldmatrix addresses: A = weight rows 16*warp + lane%16 (swizzled
  // chunk: the 16-byte column XOR row % 8, and row % 8 == lane % 8), k half
  // lane/16; B = token rows lane%8 (+8 for lanes 16..31), k half (lane/8)%2:
  // the register layouts of m16n8k16.
  const int a_row = (warp * 16 + (lane & 15)) * 128, a_half = lane >> 4, a_xor = lane & 7;
  const int b_off = C::kXOff + ((lane & 7) + ((lane >> 4) << 3)) * C::kXPitch + ((lane >> 3) & 1) * 16;
  const int g = lane >> 2, t = lane & 3;
  for (int64_t id = blockIdx.x; id < real; id += gridDim.x) {
    int64_t mslot, ntile;
    DecodeBlock(id, sch.tiles, a.ntiles, &mslot, &ntile);
    const Tile tile = PersistTile<C::kRows>(sch, num_e, mslot);
    const int64_t n0 = ntile * C::kCols;
    const bool two = tile.row_lim - tile.row0 > 8;  // warp-uniform: a second n8 half
    float acc[2][4] = {};
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      const int kvalid = static_cast<int>(Min64(C::kKC, a.k - ks * C::kKC));
      MbarWait(&full[stage], phase);
      const unsigned char* st = ring + stage * C::kStageBytes;
#pragma unroll
      for (int kk = 0; kk < C::kKC; kk += 16) {
        if (kk < kvalid) {
          const int chunk = ((kk & 63) >> 3) + a_half;
          uint32_t af[4], bf[4];
          Ldmatrix4(af, st + (kk >> 6) * C::kBoxBytes + a_row + ((chunk ^ a_xor) << 4));
          if (two) {
            Ldmatrix4(bf, st + b_off + kk * 2);
          } else {
            uint32_t b2[2];
            Ldmatrix2(b2, st + b_off + kk * 2);
            bf[0] = b2[0];
            bf[1] = b2[1];
            bf[2] = bf[3] = 0u;
          }
          Mma16816<T>(acc[0], af, bf[0], bf[1]);
          if (two) Mma16816<T>(acc[1], af, bf[2], bf[3]);
        }
      }
      // Every lane arrives: an arrive releases only its own thread's reads
      // (PTX memory model), so one lane per warp would not order the others'
      // ldmatrix before the producer's next copies into this stage.
      MbarArrive(&empty[stage]);
      advance();
    }
    // acc[h] = {(col g, token 2t), (col g, token 2t+1), (col g+8, token 2t), (col g+8, token 2t+1)}
    // of token half h.
    const int64_t c = n0 + warp * 16 + g;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t r = tile.row0 + 8 * h + 2 * t + q;
        if (r >= tile.row_lim) continue;
        if (c < a.n) out[r * a.n + c] = FromFloat16<T>(acc[h][q]);
        if (c + 8 < a.n) out[r * a.n + c + 8] = FromFloat16<T>(acc[h][2 + q]);
      }
  }
  const int64_t total = real + CeilDiv(a.m - sch.rows, C::kRows) * a.ntiles;
  for (int64_t id = real + blockIdx.x; id < total; id += gridDim.x)
    ZeroTailChunk<C::kRows, C::kCols>(out, a, sch.rows, id - real, threadIdx.x, Consumers * 32);
#endif
}

// Persistent when the launch would be at least this many waves of resident
// blocks (an upper bound: spare slots included). Below, the block per tile
// balances the last wave better on the H200: Qwen3-235B gate/up at 1 token
// 56 vs 60 us, Mixtral gate/up at 1 token (5 waves) 124 vs 128 us.
constexpr int64_t kPersistWaves = 6;

// How full the waves of `blocks` blocks are on `resident` slots (1: no slot
// idles in the last wave).
inline double WaveFill(int64_t blocks, int64_t resident) {
  const int64_t waves = (blocks + resident - 1) / resident;
  return waves > 0 ? static_cast<double>(blocks) / static_cast<double>(waves * resident) : 1.0;
}

// Below kPersistWaves the persistent form (4 blocks per SM, one k step per
// trip) still wins when the block per tile (3 per SM, two k steps) would
// leave most of its last wave idle: Qwen3-30B's down projection at 1 token,
// 512 tiles on 396 slots (1.3 waves), ran 11.4 vs 13.9 us on the H200. The
// tiles are estimated from M and E (the sizes are on the device): experts
// touched min(E, M), each ceil(rows / 8) tiles at an even spread.
inline bool SkinnyPersistentWins(const GemmArgs& a, int64_t groups, int block_resident,
                                 int persistent_resident) {
  if (block_resident <= 0 || persistent_resident <= 0 || groups <= 0) return false;
  const int64_t touched = groups < a.m ? groups : a.m;
  const int64_t per = (a.m + touched - 1) / touched;
  int64_t tiles = touched * ((per + kSR - 1) / kSR);
  if (tiles > a.mslots - 1) tiles = a.mslots - 1;
  const int64_t blocks = tiles * a.ntiles;
  constexpr double kMargin = 0.1;  // the persistent form's k loop is a little slower
  return WaveFill(blocks, persistent_resident) > WaveFill(blocks, block_resident) + kMargin;
}

// ---------------------------------------------------------------------------
// f32: exact SIMT FMA
// ---------------------------------------------------------------------------

constexpr int kBKf = 8;
// Operands are stored k-major ([k][row]); +4 keeps float4 alignment and makes
// the transposing stores conflict-free (bank = 4*k + row).
constexpr int kLdf = kBMf + 4;

// Four consecutive k of one row into registers. `src` points at the row's
// element for this chunk, or is null for a row out of range; `rem` counts the
// elements left in the row from there. float4 only when all four are in
// bounds and aligned, else element-wise with zero fill.
__device__ __forceinline__ void LoadF4(float (&v)[4], const float* src, int64_t rem, bool vec) {
  if (src != nullptr && rem > 0) {
    if (vec && rem >= 4) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(src));
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = j < rem ? src[j] : 0.f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = 0.f;
  }
}

__device__ void GemmTileF32(const float* __restrict__ x, const float* __restrict__ w,
                            float* __restrict__ out, const Tile& tile, const RowSource& src,
                            int64_t n0, int64_t n, int64_t k, bool vec_in, bool vec_out) {
  __shared__ __align__(16) float sa[2][kBKf][kLdf];
  __shared__ __align__(16) float sb[2][kBKf][kLdf];
  const int64_t row0 = tile.row0, row_lim = tile.row_lim;
  const int tid = threadIdx.x;
  const int lr = tid >> 1, lk = (tid & 1) * 4;  // loader: row, first k
  const int ty = tid >> 4, tx = tid & 15;       // compute: 16 x 16 threads
  const int64_t ktiles = CeilDiv(k, kBKf);
  // Row pointers are fixed for the whole K loop; null marks a row out of range.
  const int64_t xr = row0 + lr < row_lim ? src.Row(row0 + lr) : -1;
  const float* a_src = xr >= 0 ? x + xr * k + lk : nullptr;
  const float* b_src = n0 + lr < n ? w + (tile.expert * n + n0 + lr) * k + lk : nullptr;

  float ra[4], rb[4];
  auto gload = [&](int64_t k0) {
    const int64_t rem = k - k0 - lk;
    LoadF4(ra, a_src ? a_src + k0 : nullptr, rem, vec_in);
    LoadF4(rb, b_src ? b_src + k0 : nullptr, rem, vec_in);
  };
  auto sstore = [&](int buf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sa[buf][lk + j][lr] = ra[j];
      sb[buf][lk + j][lr] = rb[j];
    }
  };

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  __syncthreads();  // the previous grid-stride tile may still read sa/sb
  if (ktiles > 0) {
    gload(0);
    sstore(0);
  }
  __syncthreads();
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    const int buf = static_cast<int>(kt & 1);
    const bool more = kt + 1 < ktiles;
    if (more) gload((kt + 1) * kBKf);  // in flight during the FMAs below
#pragma unroll
    for (int kk = 0; kk < kBKf; ++kk) {
      // Rows ty*4.. and 64+ty*4.., columns tx*4.. and 64+tx*4..: float4 reads
      // that are broadcast (A) or contiguous (B) across the warp.
      const float4 a0 = *reinterpret_cast<const float4*>(&sa[buf][kk][ty * 4]);
      const float4 a1 = *reinterpret_cast<const float4*>(&sa[buf][kk][64 + ty * 4]);
      const float4 b0 = *reinterpret_cast<const float4*>(&sb[buf][kk][tx * 4]);
      const float4 b1 = *reinterpret_cast<const float4*>(&sb[buf][kk][64 + tx * 4]);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (more) sstore(buf ^ 1);  // that buffer was last read before the barrier below
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t grow = row0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
    if (grow >= row_lim) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t gcol = n0 + h * 64 + tx * 4;
      if (gcol >= n) continue;
      float* dst = out + grow * n + gcol;
      if (vec_out && gcol + 4 <= n) {
        *reinterpret_cast<float4*>(dst) =
            make_float4(acc[i][h * 4], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (gcol + q < n) dst[q] = acc[i][h * 4 + q];
      }
    }
  }
}

// Two blocks per SM (<= 128 registers).
__global__ void __launch_bounds__(kThreads, 2)
    GroupGemmF32Kernel(const float* __restrict__ x, const float* __restrict__ w,
                       const int32_t* __restrict__ sizes, float* __restrict__ out, GemmArgs a) {
  PdlStart(a);
  ForEachTile<kBMf, kBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    PdlWait();  // x may be the previous kernel's output
    GemmTileF32(x, w, out, tile, a.src, n0, a.n, a.k, a.vec_in, a.vec_out);
  });
  PdlWait();  // a block without tiles too: this grid ends after its primary
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Fills the schedule part of `a` for tiles of bm x bn; returns the grid size.
inline unsigned Schedule(GemmArgs& a, int64_t groups, int64_t bm, int64_t bn) {
  a.num_experts = groups;
  a.mslots = MSlots(a.m, bm, groups);
  a.ntiles = (a.n + bn - 1) / bn;
  a.total_blocks = a.mslots * a.ntiles;
  return static_cast<unsigned>(a.total_blocks < kMaxGrid ? a.total_blocks : kMaxGrid);
}

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

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no
// link against libcuda); null when the driver does not have it.
using TensorMapEncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                       const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                       const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion,
                                       CUtensorMapFloatOOBfill);
inline TensorMapEncodeFn TensorMapEncode() {
  static const TensorMapEncodeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<TensorMapEncodeFn>(nullptr);
    }
    return reinterpret_cast<TensorMapEncodeFn>(p);
  }();
  return fn;
}

// From this K on, the TMA kernel takes launches of at least 1.5 tiles per
// SM: Mixtral's down projection (K = 14336) at 16 tokens, 320 tiles (upper
// bound) on 132 SMs, ran 238.7 us against 260.5 for tile 8 on the H200 (run
// 9.2); at K <= 7168 and T = 1 tile 8 was as fast or faster (DeepSeek-V3
// gate/up 122.8 vs 123.2 us, down 65.3 vs 72.7).
constexpr int64_t kTmaLongK = 8192;

// The TMA kernel as one resident grid, when the launch has at least
// `min_per_sm` tiles per SM (upper bound; 1.5 from K = kTmaLongK; 0: any
// launch). *ran is false (nothing launched) when it has fewer, or when the
// driver cannot encode the weight map or the occupancy query fails. Needs a
// device of compute capability 9.0+, w 16-byte aligned, K % 8 == 0 (the
// caller's vec_in), E*N and K < 2^31 - 256 (int32 coordinates), E <=
// kPersistMaxE, M < 2^31.
template <typename T, int Consumers, int Stages, int KB>
cudaError_t LaunchTma(cudaStream_t stream, const uint16_t* x, const uint16_t* w,
                      const int32_t* sizes, uint16_t* out, GemmArgs a, int64_t groups,
                      int64_t min_per_sm, bool pdl, bool* ran) {
  using C = TmaCfg<Consumers, Stages, KB>;
  constexpr auto kernel = GroupGemmTmaKernel<T, Consumers, Stages, KB>;
  *ran = false;
  const cudaError_t attr = EnsureDynamicSmem<kernel>(C::kSmem);  // before the occupancy query
  if (attr != cudaSuccess) return attr;
  const int resident = ResidentBlocks<kernel>(C::kThreads, C::kSmem);
  const int64_t sms = DeviceSms();
  Schedule(a, groups, C::kRows, C::kCols);
  // Long tiles amortise the kernel's start with fewer of them.
  const bool enough = a.total_blocks >= min_per_sm * sms ||
                      (a.k >= kTmaLongK && 2 * a.total_blocks >= 3 * sms);
  if (resident <= 0 || sms <= 0 || !enough) return cudaSuccess;
  const TensorMapEncodeFn encode = TensorMapEncode();
  if (encode == nullptr) return cudaSuccess;
  // w as a 2-D tensor of E*N rows of K elements; boxes of kCols rows x 64 k,
  // zero-filled outside it.
  CUtensorMap wmap;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(a.k), static_cast<cuuint64_t>(groups * a.n)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(a.k) * 2};
  const cuuint32_t box[2] = {64, C::kCols};
  const cuuint32_t estrides[2] = {1, 1};
  if (encode(&wmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<uint16_t*>(w), dims, strides,
             box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaSuccess;
  *ran = true;
  return LaunchKernel(kernel, static_cast<unsigned>(resident), C::kThreads, C::kSmem, stream, pdl,
                      wmap, x, sizes, out, a);
}

// The TMA kernel's shape: 128 columns, 4 stages of one 64-k box, 2 blocks
// per SM. H200, scripts/decode_gemm_bench.cu at 16 tokens (run 10.2,
// 2026-11-30), against 3 stages (3 blocks per SM): Mixtral gate/up 445.4 vs
// 459.2 us, down 228.4 vs 240.9, Qwen3-30B gate/up 129.5 vs 133.2; Qwen3-235B
// and DeepSeek-V3 within 1% either way. 256 columns (16 consumer warps) was
// as fast for Mixtral and up to 1.6% slower elsewhere; 5-6 stages, two boxes
// a stage and 64 columns no faster. The launches it takes: at least 6 tiles
// per SM (upper bound; two resident grids of the 3-stage shape). Below, at
// one token, the block-per-tile skinny kernel was faster (Qwen3-30B gate/up
// 17.8 vs 29.9 us).
constexpr int kTmaConsumers = 8, kTmaStages = 4, kTmaBoxes = 1;
constexpr int64_t kTmaMinPerSm = 6;

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
        // 128 on the H200 (run G in benchmarks/RESULTS.md): one block per SM
        // hides less latency. MmaTile keeps the BN parameter for the next try.
        return LaunchMma<T, 128, kBN>(stream, xp, wp, sizes, op, a, d.groups, pdl);
    }
  }
}

// `scratch` (bytes) is only used by the sm90 path (tile_m = 256).
ffi::Error GroupGemmCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> expert_sizes, ffi::Buffer<ffi::S32> rows,
                         bool gather, int64_t topk, int64_t tile_m,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> scratch) {
  GemmDims d;
  if (auto err = CheckGroupGemm(x, w, expert_sizes, rows, gather, topk, tile_m, *out, &d);
      err.failure())
    return err;
  return DispatchFloat(x.element_type(), "x", [&]<DType DT>() -> ffi::Error {
    if (d.m == 0 || d.n == 0) return ffi::Error::Success();  // nothing to write
    const int32_t* row_src = gather ? rows.typed_data() : nullptr;
#ifdef JAX_MOE_WITH_SM90
    if constexpr (DT != DType::F32) {
      if (tile_m == 256) {
        Sm90GemmCall call{};
        call.stream = stream;
        call.bf16 = DT == DType::BF16;
        call.x = x.untyped_data();
        call.w = w.untyped_data();
        call.sizes = expert_sizes.typed_data();
        call.rows = row_src;
        call.topk = topk;
        call.out = out->untyped_data();
        call.m = d.m;
        call.n = d.n;
        call.k = d.k;
        call.groups = d.groups;
        call.x_rows = d.x_rows;
        call.scratch = scratch->untyped_data();
        call.scratch_bytes = scratch->size_bytes();
        bool ran = false;
        const cudaError_t err = GroupGemmSm90(call, &ran);
        if (err != cudaSuccess)
          return ffi::Error::Internal(std::string("jax_moe: group_gemm (sm90) launch failed: ") +
                                      cudaGetErrorString(err));
        if (ran) return ffi::Error::Success();
      }
    }
#endif
    const cudaError_t err = LaunchGroupGemm<DT>(
        stream, x.untyped_data(), w.untyped_data(), expert_sizes.typed_data(),
        out->untyped_data(), d, row_src, topk, tile_m == 256 ? 128 : tile_m);
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_moe: group_gemm launch failed: ") +
                                  cudaGetErrorString(err));
    return ffi::Error::Success();
  });
}

}  // namespace

cudaError_t LaunchGroupGemmFor(cudaStream_t stream, DType dtype, const void* x,
                               const void* w, const int32_t* sizes, void* out, const GemmDims& d,
                               const int32_t* rows, int64_t topk, int64_t tile_m, bool pdl,
                               bool wait_first) {
  switch (dtype) {
    case DType::F32:
      return LaunchGroupGemm<DType::F32>(stream, x, w, sizes, out, d, rows, topk, tile_m,
                                                 pdl, wait_first);
    case DType::BF16:
      return LaunchGroupGemm<DType::BF16>(stream, x, w, sizes, out, d, rows, topk, tile_m,
                                                  pdl, wait_first);
    default:
      return LaunchGroupGemm<DType::F16>(stream, x, w, sizes, out, d, rows, topk, tile_m,
                                                 pdl, wait_first);
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kGroupGemmCuda, GroupGemmCuda,
    GroupGemmSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
