// Steps 4 and 6 on the GPU: out[rows of group e] = x[rows of e] @ w[e]^T with
// f32 accumulation; rows past sum(expert_sizes) are zero. Same semantics as
// csrc/cpu/group_gemm.cc: negative sizes count as 0 and groups are clamped to M.
//
// Design
//  * One launch, no host sync: the grid has an upper bound of "m-slots"
//    (ceil(M/BM) + E + 1 >= sum_e ceil(rows_e/BM) + 1) times ceil(N/BN) column
//    tiles. Every block recomputes the per-expert tile schedule from
//    expert_sizes on the device (a block-wide prefix scan, 1024 experts per
//    pass) and finds the (expert, row tile) its m-slot owns. Slots past the
//    last tile are "spare": together they zero the tail rows [sum, M).
//  * The grid is 1-D and grouped: kGroupM m-slots walk the column tiles
//    together so that the blocks in flight share x row tiles and w[e] column
//    tiles in L2 (a plain 2-D grid would stream all of x once per column tile).
//    A grid-stride loop over the linear block id removes every grid-size limit.
//  * bf16/f16: tensor cores (mma.sync m16n8k16 fed by ldmatrix), f32
//    accumulate. 128x128x32 tiles, 8 warps of 64x32, a 3-stage cp.async
//    pipeline in dynamic shared memory.
//  * f32: exact-f32 SIMT FMA (no TF32): 128x128x8 tiles, 8x8 outputs per
//    thread, operands transposed into shared memory, register prefetch of the
//    next k tile.
//  * Edges: 16-byte loads/stores only where the row is 16-byte aligned and the
//    whole vector is in bounds; everything else goes element by element with
//    zero fill, so any M, N, K (odd ones too) is safe.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "ffi_common.h"
#include "ops.h"
#include "shape_checks.h"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;  // 8 warps, both kernels
constexpr int kWarps = kThreads / 32;
constexpr int kBM = 128;       // rows of x per tile (the schedule's unit)
constexpr int kBN = 128;       // columns of out per tile
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
  int64_t row_lim;      // min(row0 + kBM, end of the expert's rows)
  int64_t tiles_total;  // valid when expert < 0: number of real tiles
  int64_t rows_total;   // valid when expert < 0: min(sum of sizes, M)
};

// Inclusive block-wide scan; *total gets the sum over the block. Contains one
// __syncthreads; the caller keeps `warp_sums` untouched until the next barrier.
__device__ __forceinline__ int64_t BlockInclusiveScan(int64_t v, int64_t* warp_sums,
                                                      int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int64_t before = 0, all = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) {
    const int64_t s = warp_sums[i];
    before += i < warp ? s : 0;
    all += s;
  }
  *total = all;
  return v + before;
}

// Expert e owns rows [min(P_e, M), min(P_{e+1}, M)) with P_e the prefix sum of
// max(size, 0): exactly the CPU loop's clamping. Its tiles are numbered from
// the prefix sum of ceil(rows/kBM). Must be called by the whole block.
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
      tiles_local += CeilDiv(Min64(p, m) - st, kBM);
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
        const int64_t n = CeilDiv(en - st, kBM);
        if (!done && slot < t + n) {
          const int64_t row0 = st + (slot - t) * kBM;
          s_found[0] = first + i;
          s_found[1] = row0;
          s_found[2] = Min64(row0 + kBM, en);
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

// Spare slot: zero rows [rows_total, M) of this column tile, striding by
// kBM-row blocks over all spare slots so each tail row is written exactly once
// per column tile. With `vec` (N a multiple of 16 bytes' worth of elements and
// out 16-byte aligned) every row piece starts aligned and is a whole number of
// 16-byte vectors, so the stores are uint4.
template <typename S>
__device__ void ZeroTail(S* __restrict__ out, const Tile& tile, int64_t mslot, int64_t mslots,
                         int64_t n0, int64_t n, int64_t m, bool vec) {
  const int64_t spare = mslot - tile.tiles_total;    // >= 0
  const int64_t nspare = mslots - tile.tiles_total;  // >= 1 (grid has a spare slot)
  const int cols = static_cast<int>(Min64(kBN, n - n0));
  // Vector width in elements: 16 bytes when `vec`, else one element.
  const int width = vec ? static_cast<int>(16 / sizeof(S)) : 1;
  const int per_row = (cols + width - 1) / width;  // exact when vec
  const int row_slots = kBN / width;
  for (int64_t r0 = tile.rows_total + spare * kBM; r0 < m; r0 += nspare * kBM) {
    for (int i = threadIdx.x; i < kBM * row_slots; i += kThreads) {
      const int64_t r = r0 + i / row_slots;
      const int c = i % row_slots;
      if (r >= m || c >= per_row) continue;
      S* dst = out + r * n + n0 + c * width;
      if (vec) *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      else *dst = S(0);
    }
  }
}

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
constexpr int kTileElems = kBM * kLds;                 // one operand, one stage
constexpr int kSmem16 = 2 * kStages * kTileElems * 2;  // 61440 bytes
constexpr int kRowChunks = kBK / 8;                    // 16-byte chunks per tile row
constexpr int kRowStep = kThreads / kRowChunks;         // rows one loader pass covers
constexpr int kChunks16 = kBM / kRowStep;               // passes per operand
// Epilogue staging: each warp's 64x32 tile, already rounded, rows padded to
// 80 bytes so the fragment-order writes are conflict-free.
constexpr int kLdo = 32 + 8;
static_assert(kBN == kBM, "A and B stages share one size");
static_assert(kChunks16 * kRowStep == kBM && kRowChunks * kRowStep == kThreads,
              "loader covers the tile");
static_assert(kWarps * 64 * kLdo * 2 <= kSmem16, "epilogue staging fits the pipeline buffers");

template <typename T>
__device__ __forceinline__ uint16_t FromFloat16(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

__device__ __forceinline__ uint32_t Pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and register i returns row lane/4, columns 2*(lane%4)..+1 of matrix i.
__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

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

template <typename T>
__device__ void GemmTile16(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                           uint16_t* __restrict__ out, const Tile& tile, int64_t n0, int64_t n,
                           int64_t k, bool vec_in, bool vec_out, unsigned char* smem) {
  uint16_t* sa = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sb = sa + kStages * kTileElems;
  const int64_t row0 = tile.row0, row_lim = tile.row_lim;
  const int64_t ktiles = CeilDiv(k, kBK);

  // Loader: thread owns rows lrow + kRowStep*it of both operands, columns
  // lcol..+7 of each k tile. Row pointers are fixed for the whole K loop.
  const int lrow = threadIdx.x / kRowChunks, lcol = (threadIdx.x % kRowChunks) * 8;
  const uint16_t* a_src[kChunks16];
  const uint16_t* b_src[kChunks16];
  {
    const uint16_t* we = w + tile.expert * n * k;
#pragma unroll
    for (int it = 0; it < kChunks16; ++it) {
      const int64_t ar = row0 + lrow + it * kRowStep, br = n0 + lrow + it * kRowStep;
      a_src[it] = ar < row_lim ? x + ar * k + lcol : nullptr;
      b_src[it] = br < n ? we + br * k + lcol : nullptr;
    }
  }
  auto load_stage = [&](int stage, int64_t kt) {
    const int64_t k0 = kt * kBK;
    const int64_t rem = k - k0 - lcol;
    uint16_t* da = sa + stage * kTileElems + lrow * kLds + lcol;
    uint16_t* db = sb + stage * kTileElems + lrow * kLds + lcol;
#pragma unroll
    for (int it = 0; it < kChunks16; ++it) {
      LoadChunk16(da + it * kRowStep * kLds, a_src[it] ? a_src[it] + k0 : nullptr, rem, vec_in);
      LoadChunk16(db + it * kRowStep * kLds, b_src[it] ? b_src[it] + k0 : nullptr, rem, vec_in);
    }
  };

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp & 1;   // 2 warps along M: 64 rows each
  const int wn = warp >> 1;  // 4 warps along N: 32 columns each
  // ldmatrix row addresses. A (row-major 16x16): matrices (rows 0-7|8-15) x
  // (k 0-7|8-15) give a0..a3 of m16n8k16. B is stored n-major (w is N x K),
  // which is exactly the "col" operand: matrices (k 0-7, k 8-15) of n 0-7,
  // then of n 8-15, give {b0, b1} of two n8 tiles.
  const int a_off = (wm * 64 + (lane & 15)) * kLds + (lane >> 4) * 8;
  const int b_off = (wn * 32 + (lane & 7) + ((lane >> 4) << 3)) * kLds + ((lane >> 3) & 1) * 8;

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
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

    const uint16_t* ta = sa + stage * kTileElems + a_off;
    const uint16_t* tb = sb + stage * kTileElems + b_off;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t bf[2][4];  // bf[p] = {b0, b1} of n8 tile 2p, then of 2p+1
      Ldmatrix4(bf[0], tb + kk);
      Ldmatrix4(bf[1], tb + 16 * kLds + kk);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t af[4];
        Ldmatrix4(af, ta + i * 16 * kLds + kk);
#pragma unroll
        for (int j = 0; j < 4; ++j)
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
  uint16_t* st = reinterpret_cast<uint16_t*>(smem) + warp * 64 * kLdo;
  {
    const int g = lane >> 2, t2 = (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint16_t* p = st + (i * 16 + g) * kLdo + j * 8 + t2;
        *reinterpret_cast<uint32_t*>(p) =
            Pack2(FromFloat16<T>(acc[i][j][0]), FromFloat16<T>(acc[i][j][1]));
        *reinterpret_cast<uint32_t*>(p + 8 * kLdo) =
            Pack2(FromFloat16<T>(acc[i][j][2]), FromFloat16<T>(acc[i][j][3]));
      }
  }
  __syncwarp();
#pragma unroll
  for (int q = lane; q < 64 * 4; q += 32) {
    const int r = q >> 2, c = (q & 3) * 8;
    const int64_t grow = row0 + wm * 64 + r;
    const int64_t gcol = n0 + wn * 32 + c;
    if (grow < row_lim && gcol < n) {
      const uint16_t* s = st + r * kLdo + c;
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

// Two blocks per SM (<= 128 registers, 2 x 60 KB shared memory).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    GroupGemm16Kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                      const int32_t* __restrict__ sizes, uint16_t* __restrict__ out, int64_t m,
                      int64_t n, int64_t k, int64_t num_experts, int64_t mslots, int64_t ntiles,
                      int64_t total_blocks, bool vec_in, bool vec_out) {
  extern __shared__ __align__(128) unsigned char smem16[];
  for (int64_t id = blockIdx.x; id < total_blocks; id += gridDim.x) {
    int64_t mslot, ntile;
    DecodeBlock(id, mslots, ntiles, &mslot, &ntile);
    const Tile tile = FindTile(sizes, num_experts, m, mslot);
    const int64_t n0 = ntile * kBN;
    if (tile.expert < 0) {
      ZeroTail(out, tile, mslot, mslots, n0, n, m, vec_out);
    } else {
      GemmTile16<T>(x, w, out, tile, n0, n, k, vec_in, vec_out, smem16);
    }
  }
}

// ---------------------------------------------------------------------------
// f32: exact SIMT FMA
// ---------------------------------------------------------------------------

constexpr int kBKf = 8;
// Operands are stored k-major ([k][row]); +4 keeps float4 alignment and makes
// the transposing stores conflict-free (bank = 4*k + row).
constexpr int kLdf = kBM + 4;

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
                            float* __restrict__ out, const Tile& tile, int64_t n0, int64_t n,
                            int64_t k, bool vec_in, bool vec_out) {
  __shared__ __align__(16) float sa[2][kBKf][kLdf];
  __shared__ __align__(16) float sb[2][kBKf][kLdf];
  const int64_t row0 = tile.row0, row_lim = tile.row_lim;
  const int tid = threadIdx.x;
  const int lr = tid >> 1, lk = (tid & 1) * 4;  // loader: row, first k
  const int ty = tid >> 4, tx = tid & 15;       // compute: 16 x 16 threads
  const int64_t ktiles = CeilDiv(k, kBKf);
  // Row pointers are fixed for the whole K loop; null marks a row out of range.
  const float* a_src = row0 + lr < row_lim ? x + (row0 + lr) * k + lk : nullptr;
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
                       const int32_t* __restrict__ sizes, float* __restrict__ out, int64_t m,
                       int64_t n, int64_t k, int64_t num_experts, int64_t mslots, int64_t ntiles,
                       int64_t total_blocks, bool vec_in, bool vec_out) {
  for (int64_t id = blockIdx.x; id < total_blocks; id += gridDim.x) {
    int64_t mslot, ntile;
    DecodeBlock(id, mslots, ntiles, &mslot, &ntile);
    const Tile tile = FindTile(sizes, num_experts, m, mslot);
    const int64_t n0 = ntile * kBN;
    if (tile.expert < 0) {
      ZeroTail(out, tile, mslot, mslots, n0, n, m, vec_out);
    } else {
      GemmTileF32(x, w, out, tile, n0, n, k, vec_in, vec_out);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Opting in to more than 48 KB of dynamic shared memory is a per-device
// function attribute, not a stream operation: do it once per device.
template <typename T>
cudaError_t EnsureSmem16() {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(GroupGemm16Kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kSmem16);
  if (err == cudaSuccess && bit != 0) done.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

// Launches the kernel for one dtype on `stream`; nothing else (no sync, no
// allocation). m > 0 and n > 0.
template <ffi::DataType DT>
cudaError_t LaunchGroupGemm(cudaStream_t stream, const void* x, const void* w,
                            const int32_t* sizes, void* out, int64_t m, int64_t n, int64_t k,
                            int64_t groups) {
  // m-slots: sum_e ceil(rows_e / kBM) < M / kBM + E <= ceil(M / kBM) + E, so
  // this bound leaves at least one spare slot for the tail.
  const int64_t mslots = (m + kBM - 1) / kBM + groups + 1;
  const int64_t ntiles = (n + kBN - 1) / kBN;
  const int64_t total_blocks = mslots * ntiles;
  const unsigned grid = static_cast<unsigned>(total_blocks < kMaxGrid ? total_blocks : kMaxGrid);
  if constexpr (DT == ffi::DataType::F32) {
    const auto* xp = static_cast<const float*>(x);
    const auto* wp = static_cast<const float*>(w);
    auto* op = static_cast<float*>(out);
    const bool vec_in = k % 4 == 0 && Aligned16(xp) && Aligned16(wp);
    const bool vec_out = n % 4 == 0 && Aligned16(op);
    GroupGemmF32Kernel<<<grid, kThreads, 0, stream>>>(xp, wp, sizes, op, m, n, k, groups, mslots,
                                                      ntiles, total_blocks, vec_in, vec_out);
  } else {
    using T = std::conditional_t<DT == ffi::DataType::BF16, __nv_bfloat16, __half>;
    const cudaError_t attr = EnsureSmem16<T>();
    if (attr != cudaSuccess) return attr;
    const auto* xp = static_cast<const uint16_t*>(x);
    const auto* wp = static_cast<const uint16_t*>(w);
    auto* op = static_cast<uint16_t*>(out);
    const bool vec_in = k % 8 == 0 && Aligned16(xp) && Aligned16(wp);
    const bool vec_out = n % 8 == 0 && Aligned16(op);
    GroupGemm16Kernel<T><<<grid, kThreads, kSmem16, stream>>>(
        xp, wp, sizes, op, m, n, k, groups, mslots, ntiles, total_blocks, vec_in, vec_out);
  }
  return cudaGetLastError();
}

ffi::Error GroupGemmCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> expert_sizes, ffi::Result<ffi::AnyBuffer> out) {
  GemmDims d;
  if (auto err = CheckGroupGemm(x, w, expert_sizes, *out, &d); err.failure()) return err;
  const int64_t m = d.m, k = d.k, groups = d.groups, n = d.n;
  return DispatchFloat(x.element_type(), "x", [&]<ffi::DataType DT>() -> ffi::Error {
    if (m == 0 || n == 0) return ffi::Error::Success();  // nothing to write
    const cudaError_t err =
        LaunchGroupGemm<DT>(stream, x.untyped_data(), w.untyped_data(), expert_sizes.typed_data(),
                            out->untyped_data(), m, n, k, groups);
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_moe: group_gemm launch failed: ") +
                                  cudaGetErrorString(err));
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGroupGemmCuda, GroupGemmCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
