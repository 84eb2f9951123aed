// The grouped GEMM's decode kernel for tile_m = 8 (bf16 / f16, a handful of
// rows per expert): the "skinny" kernel streams each expert's weights once
// with 16-byte loads straight into mma registers (swap-AB: weight rows are
// the mma's M side, the <= 8 token rows its N side), K split over 8 warps and
// summed in a fixed order. Two forms: a block per tile (small launches) and
// a persistent grid that scans the schedule once per block (large launches);
// both sum K in the same order, so they give the same bits. Part of the one
// translation unit of dispatch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"

namespace jax_moe {
namespace {

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
// the most loads in flight on the H200 (64 registers; docs/performance.md).
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
// Host side: which form runs
// ---------------------------------------------------------------------------

// Persistent when the launch would be at least this many waves of resident
// blocks (an upper bound: spare slots included). Below, the block per tile
// balances the last wave better: measured faster on the H200 at one token
// (docs/performance.md).
constexpr int64_t kPersistWaves = 6;

// How full the waves of `blocks` blocks are on `resident` slots (1: no slot
// idles in the last wave).
inline double WaveFill(int64_t blocks, int64_t resident) {
  const int64_t waves = (blocks + resident - 1) / resident;
  return waves > 0 ? static_cast<double>(blocks) / static_cast<double>(waves * resident) : 1.0;
}

// Below kPersistWaves the persistent form (4 blocks per SM, one k step per
// trip) still wins when the block per tile (3 per SM, two k steps) would
// leave most of its last wave idle (e.g. 512 tiles on 396 slots, 1.3 waves:
// measured faster on the H200; docs/performance.md). The tiles are estimated
// from M and E (the sizes are on the device): experts touched min(E, M), each
// ceil(rows / 8) tiles at an even spread.
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

}  // namespace
}  // namespace jax_moe
