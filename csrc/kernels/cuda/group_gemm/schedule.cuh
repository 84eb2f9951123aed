// The grouped GEMM's tile schedule, shared by every kernel family of
// csrc/kernels/cuda/group_gemm/: the per-expert tile numbering recomputed on
// the device from expert_sizes, the grouped raster of the grid, the tail
// zeroing, the launch arguments, the grid-stride loops and the persistent
// schedule. Included by dispatch.cu (one translation unit instantiates every
// kernel); kernels and helpers stay in an anonymous namespace.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

constexpr int kThreads = 256;  // 8 warps, every kernel
constexpr int kWarps = kThreads / 32;
constexpr int kBN = 128;       // columns of out per tile (tensor-core and f32 kernels)
constexpr int kGroupM = 8;     // m-slots per raster group (L2 reuse)
constexpr int kScanPer = 4;    // experts per thread per schedule pass
constexpr int64_t kMaxGrid = 2147483647;

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------
// Tile schedule (shared by every kernel)
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

// ---------------------------------------------------------------------------
// Host side of the schedule
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

}  // namespace
}  // namespace jax_moe
