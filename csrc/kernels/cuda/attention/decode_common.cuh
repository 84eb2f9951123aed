// Device code shared by the paged decode kernels (decode_split_simt.cu,
// decode_split_mma.cu, decode_combine.cu; the algorithm is described in
// paged_decode.cu): the block and warp layout of the split kernels, their
// setup (which tokens and cache slots a block reads), the per-warp cp.async
// ring's copies and the merge of the warps' softmax states; and the host
// launcher of a split kernel.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ int64_t ClampLength(int32_t len, int64_t max_tokens) {
  const int64_t l = len;
  return l < 0 ? 0 : (l > max_tokens ? max_tokens : l);
}

// Where one block of the split kernels works: sequence b, kv head kvh, query
// heads h0 .. h0 + ng - 1 (one chunk of the GQA group), split sp holding the
// tokens t0 .. t0 + ntok - 1.
struct SplitBlock {
  int64_t b, kvh, sp, t0, h0;
  int ntok, ng;
};

// Fills `blk` for this block (heads per chunk: `rows`); false when its split
// holds no token (the combine kernel never reads such a split). Otherwise
// also stores the cache slot of each of the split's tokens in slot_of (-1: a
// page id outside [0, num_pages), skipped); the caller syncs before reading.
// The split's page ids are loaded once per page, kPageLoads per thread issued
// before any is used, into `pages` (the not yet used ring; room for
// kDecodeMaxSplitTokens + 1 ids). A load per token, each behind a 64-bit
// division, keeps the block's first K/V copies waiting on a chain of
// dependent table loads: measured slower on the H200 at pages of 16 (see
// docs/performance.md).
constexpr int kPageLoads = 4;
__device__ __forceinline__ bool SetupSplit(SplitBlock& blk, int rows,
                                           const int32_t* __restrict__ table,
                                           const int32_t* __restrict__ lengths, int64_t hkv,
                                           int64_t group, int64_t head_chunks, int64_t num_pages,
                                           int64_t page_size, int64_t max_pages, int split,
                                           int32_t* pages, int32_t* slot_of) {
  const int64_t chunk = blockIdx.x % head_chunks;
  const int64_t bk = blockIdx.x / head_chunks;
  blk.b = bk / hkv;
  blk.kvh = bk % hkv;
  blk.sp = blockIdx.y;
  const int64_t len = ClampLength(lengths[blk.b], max_pages * page_size);
  blk.t0 = blk.sp * split;
  if (len <= blk.t0) return false;
  blk.ntok = static_cast<int>(len - blk.t0 < split ? len - blk.t0 : split);
  blk.ng = static_cast<int>(group - chunk * rows < rows ? group - chunk * rows : rows);
  blk.h0 = blk.kvh * group + chunk * rows;
  // Tokens t0 .. t0 + ntok - 1 lie on pages p0 .. p0 + npages - 1 of the
  // sequence, the first from offset `off`. page_size < 2^31 (the handler
  // rejects caches of 2^31 slots), so off + i fits 32 bits.
  const int64_t p0 = blk.t0 / page_size;
  const uint32_t ps = static_cast<uint32_t>(page_size);
  const uint32_t off = static_cast<uint32_t>(blk.t0 - p0 * page_size);
  const int npages = static_cast<int>((off + blk.ntok - 1) / ps) + 1;
  const int32_t* row_pages = table + blk.b * max_pages + p0;
  for (int i0 = threadIdx.x; i0 < npages; i0 += kPageLoads * kDecodeThreads) {
    int32_t pg[kPageLoads];
#pragma unroll
    for (int j = 0; j < kPageLoads; ++j) {
      const int i = i0 + j * kDecodeThreads;
      pg[j] = i < npages ? __ldg(row_pages + i) : -1;
    }
#pragma unroll
    for (int j = 0; j < kPageLoads; ++j) {
      const int i = i0 + j * kDecodeThreads;
      if (i < npages) pages[i] = pg[j];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < blk.ntok; i += kDecodeThreads) {
    const uint32_t u = off + static_cast<uint32_t>(i);
    const uint32_t pi = u / ps;
    const int64_t page = pages[pi];
    slot_of[i] = (page >= 0 && page < num_pages)
                     ? static_cast<int32_t>(page * page_size + (u - pi * ps)) : -1;
  }
  return true;
}

// The number of tiles of `rows` tokens of a split of ntok tokens that warp
// `warp` takes (tiles warp, warp + kDecodeWarps, ...).
__device__ __forceinline__ int WarpTiles(int ntok, int rows, int warp) {
  const int ntiles = (ntok + rows - 1) / rows;
  return ntiles > warp ? (ntiles - warp + kDecodeWarps - 1) / kDecodeWarps : 0;
}

// Where this block's K and V rows lie in the caches: row u = slot * hkv +
// kvh of k_pages (v_pages) starts at element u * dk (u * dv); k_chunks
// (v_chunks) 16-byte chunks of it are K's (V's).
struct CacheRows {
  int64_t hkv, kvh;
  int dk, dv, k_chunks, v_chunks;
};

// The split kernels' per-warp cp.async ring: copies this warp's i-th tile
// (tile warp + i * kDecodeWarps of the split: kRows token rows of kChunks
// 16-byte chunks of this kv head's K and V) into stage i % kStages of
// my_ring (kVecs chunks per stage and tensor, K then V), chunk c of row r at
// pos(r, c). kChunks covers the kernel's compiled head dim; chunks past a
// row's own (rows.k_chunks, rows.v_chunks: head dims smaller than the
// compiled one) are zero-filled, as are skipped tokens, without reading
// memory. Always commits a group (empty past the last tile) so that the
// caller's wait counts uniformly.
template <int kRows, int kChunks, int kStages, int kVecs, typename T, typename Pos>
__device__ __forceinline__ void IssueTile(int i, int my_tiles, int warp, int lane, int ntok,
                                          const int32_t* slot_of, const CacheRows& rows,
                                          const T* __restrict__ kc, const T* __restrict__ vc,
                                          uint4* my_ring, Pos pos) {
  static_assert(kRows * kChunks % 32 == 0, "whole chunks per lane");
  constexpr int kVec = 16 / sizeof(T);  // elements per chunk
  if (i < my_tiles) {
    const int base = (warp + i * kDecodeWarps) * kRows;
    uint4* dk = my_ring + (i % kStages) * 2 * kVecs;
#pragma unroll
    for (int j = 0; j < kRows * kChunks / 32; ++j) {
      const int v = lane + 32 * j;
      const int r = v / kChunks, c = v % kChunks;
      const int tok = base + r;
      const int64_t slot = tok < ntok ? slot_of[tok] : -1;
      const int64_t u = slot * rows.hkv + rows.kvh;
      const bool kin = slot >= 0 && c < rows.k_chunks;
      const bool vin = slot >= 0 && c < rows.v_chunks;
      const int64_t koff = kin ? u * rows.dk + c * kVec : 0;
      const int64_t voff = vin ? u * rows.dv + c * kVec : 0;
      CpAsync16Zfill(dk + pos(r, c), kc + koff, kin ? 16 : 0);
      CpAsync16Zfill(dk + kVecs + pos(r, c), vc + voff, vin ? 16 : 0);
    }
  }
  CpAsyncCommit();
}

// Merges the warps' softmax states, staged in shared memory as red[warp][row][D]
// (unnormalised outputs), wm[warp][row] (running max; base 2 when kBase2) and
// wsum[warp][row] (running sum), in warp order, and writes the split's partial
// output (its first dv of the D elements; part_out rows of dv) and (max in
// natural log, sum) for the block's ng query heads.
template <int kRows, int D, bool kBase2>
__device__ __forceinline__ void StoreSplit(const float* red, const float* wm, const float* wsum,
                                           const SplitBlock& blk, int64_t hq, int64_t num_splits,
                                           int dv, float* __restrict__ part_out,
                                           float* __restrict__ part_stats) {
  for (int idx = threadIdx.x; idx < blk.ng * D; idx += kDecodeThreads) {
    const int r = idx / D, e = idx % D;
    if (e >= dv) continue;  // past V's head dim: zeros, not stored
    float mx = wm[r];
#pragma unroll
    for (int w = 1; w < kDecodeWarps; ++w) mx = fmaxf(mx, wm[w * kRows + r]);
    float acc = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float mw = wm[w * kRows + r];
      // a warp without valid token: weight 0
      const float a = mw == -INFINITY ? 0.f : (kBase2 ? exp2f(mw - mx) : expf(mw - mx));
      acc += a * red[(w * kRows + r) * D + e];
      sum += a * wsum[w * kRows + r];
    }
    const int64_t part = (blk.b * hq + blk.h0 + r) * num_splits + blk.sp;
    part_out[part * dv + e] = acc;
    if (e == 0) {
      part_stats[part * 2] = kBase2 ? mx * 0.6931471805599453f : mx;  // the combine's base e
      part_stats[part * 2 + 1] = sum;
    }
  }
}

// The head dim a decode kernel is compiled for that serves `dim` (<= 256):
// 64, 128 or 256. Smaller dims run zero-filled (see IssueTile).
inline int DecodeTileDim(int64_t dim) { return dim <= 64 ? 64 : (dim <= 128 ? 128 : 256); }

// Launches a split kernel on a grid of (batch x kv heads x chunks of `rows`
// query heads, splits) with ring_bytes + 4 bytes per split token of dynamic
// shared memory (opted in up to max_smem); the kernel's compiled head dim
// covers d.k_dim and d.v_dim.
template <DType DT, auto Kernel>
cudaError_t LaunchSplit(cudaStream_t stream, const DecodeDims& d, const void* q, const void* kp,
                        const void* vp, const int32_t* table, const int32_t* lengths, float scale,
                        float* part_out, float* part_stats, int rows, int ring_bytes,
                        int max_smem) {
  using T = typename DevScalar<DT>::T;
  const int64_t head_chunks = (d.group + rows - 1) / rows;
  const int64_t blocks = d.batch * d.hkv * head_chunks;
  // Never true past the handler's check batch * hq < 2^31 (head_chunks <= group).
  if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
  // The chunks of one (sequence, kv head) are neighbours on grid.x: they run
  // together and share the split's K/V through L2.
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(d.num_splits));
  if (const cudaError_t err = EnsureDynamicSmem<Kernel>(max_smem); err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  const int split = static_cast<int>(d.split_tokens);
  const int smem = ring_bytes + split * static_cast<int>(sizeof(int32_t));
  Kernel<<<grid, kDecodeThreads, smem, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(kp), static_cast<const T*>(vp), table,
      lengths, d.hq, d.hkv, d.group, head_chunks, d.num_pages, d.page_size, d.max_pages,
      d.num_splits, split, static_cast<int>(d.k_dim), static_cast<int>(d.v_dim), scale, part_out,
      part_stats);
  return cudaGetLastError();
}

}  // namespace

// The split kernels' launchers by family: f32 on the SIMT kernel
// (decode_split_simt.cu), bf16 / f16 on the tensor-core kernel
// (decode_split_mma.cu).
cudaError_t LaunchDecodeSplitSimt(cudaStream_t stream, const DecodeDims& d, const void* q,
                                  const void* k_pages, const void* v_pages,
                                  const int32_t* page_table, const int32_t* lengths, float scale,
                                  float* part_out, float* part_stats);
cudaError_t LaunchDecodeSplitMma(cudaStream_t stream, DType dtype, const DecodeDims& d,
                                 const void* q, const void* k_pages, const void* v_pages,
                                 const int32_t* page_table, const int32_t* lengths, float scale,
                                 float* part_out, float* part_stats);

}  // namespace jax_moe
