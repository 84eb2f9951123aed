// Paged KV cache on the GPU: write_kv (scatter new K/V rows into their slots,
// in place) and flash-decoding attention for one query token per sequence.
//
// Decode runs in two kernels, both with fixed reduction orders (bitwise
// reproducible run to run):
//  1. The split kernel: one block per (batch b, kv head, chunk of the query
//     heads of its GQA group, split of split_tokens tokens). Each warp
//     streams tiles of the split's K and V rows through a cp.async ring in
//     shared memory and keeps an online softmax for all the chunk's heads
//     (K/V read once, not once per head); the warps merge in order. bf16/f16:
//     DecodeSplitMmaKernel (tensor cores, 8 heads per block); f32:
//     DecodeSplitKernel (SIMT, up to 8). Per head: the split's max m and sum
//     l of exp(score - m) and the unnormalised sum of exp(score - m) * V,
//     written to the scratch outputs part_stats (B, Hq, S, 2) and part_out
//     (B, Hq, S, D). No allocation: the scratch is an extra output of the
//     custom call.
//  2. DecodeCombineKernel: one warp per (b, query head); merges the splits
//     holding tokens, in split order. On sm_90+ it is launched with
//     programmatic dependent launch, so its blocks are resident when the
//     split kernel's last blocks finish (0.6-1.6 us of ~268 us, run 15.5).
//     Merging in the split kernel's last block instead (an arrival counter
//     per block column) was slower: every block's fence and atomic, and the
//     merges in the grid's tail, cost 17-57 us (benchmarks/RESULTS.md).
// Semantics are those of the CPU handler (csrc/cpu/attention.cc): lengths are
// clamped to [0, max_pages * page_size], tokens on a page id outside
// [0, num_pages) are skipped, and a sequence without valid tokens gives 0.
#include <cfloat>
#include <utility>

#include "ffi/attention_checks.h"
#include "kernels/cuda/cuda_common.cuh"
#include "ffi/ffi_common.h"
#include "ffi/targets.h"

namespace jax_moe {
namespace {

// ---- write_kv ----------------------------------------------------------------

// One block per token (grid-stride); `Unit` is the copy granule. Slots outside
// [0, num_slots) are skipped. Duplicate slots race (Python rejects them eagerly).
template <typename Unit>
__global__ void WriteKvKernel(const Unit* __restrict__ k, const Unit* __restrict__ v,
                              const int32_t* __restrict__ slots, int64_t n,
                              int64_t units_per_row, int64_t num_slots, Unit* __restrict__ k_out,
                              Unit* __restrict__ v_out) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t s = slots[i];
    if (s < 0 || s >= num_slots) continue;  // uniform over the block
    const Unit* ks = k + i * units_per_row;
    const Unit* vs = v + i * units_per_row;
    Unit* kd = k_out + s * units_per_row;
    Unit* vd = v_out + s * units_per_row;
    for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) {
      kd[u] = ks[u];
      vd[u] = vs[u];
    }
  }
}

template <typename Unit>
ffi::Error LaunchWriteKv(cudaStream_t stream, const void* k, const void* v, const int32_t* slots,
                         int64_t n, int64_t row_bytes, int64_t num_slots, void* k_out,
                         void* v_out) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  const int threads = units >= 256 ? 256 : (units >= 128 ? 128 : 64);
  WriteKvKernel<Unit><<<GridFor(n, 1, 1u << 20), threads, 0, stream>>>(
      static_cast<const Unit*>(k), static_cast<const Unit*>(v), slots, n, units, num_slots,
      static_cast<Unit*>(k_out), static_cast<Unit*>(v_out));
  return LastCudaError("write_kv launch");
}

ffi::Error WriteKvCuda(cudaStream_t stream, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  WriteKvDims d;
  if (auto err = CheckWriteKv(k_pages, v_pages, k, v, slots, *k_out, *v_out, &d); err.failure())
    return err;
  // The outputs alias the caches (input_output_aliases), so they already hold
  // them; should XLA ever hand over distinct buffers, copy (async, on stream).
  for (auto [dst, src] : {std::pair{k_out->untyped_data(), k_pages.untyped_data()},
                          std::pair{v_out->untyped_data(), v_pages.untyped_data()}}) {
    if (dst == src || k_pages.size_bytes() == 0) continue;
    if (cudaMemcpyAsync(dst, src, k_pages.size_bytes(), cudaMemcpyDeviceToDevice, stream) !=
        cudaSuccess)
      return LastCudaError("write_kv cache copy");
  }
  if (d.n == 0 || d.row_elems == 0) return ffi::Error::Success();
  const int64_t row_bytes = d.row_elems * ffi::ByteWidth(k.element_type());
  const void* kp = k.untyped_data();
  const void* vp = v.untyped_data();
  void* ko = k_out->untyped_data();
  void* vo = v_out->untyped_data();
  if (row_bytes % 16 == 0)
    return LaunchWriteKv<uint4>(stream, kp, vp, slots.typed_data(), d.n, row_bytes, d.num_slots,
                                ko, vo);
  if (row_bytes % 4 == 0)
    return LaunchWriteKv<uint32_t>(stream, kp, vp, slots.typed_data(), d.n, row_bytes,
                                   d.num_slots, ko, vo);
  return LaunchWriteKv<uint16_t>(stream, kp, vp, slots.typed_data(), d.n, row_bytes, d.num_slots,
                                 ko, vo);
}

// ---- paged decode ------------------------------------------------------------

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
// Query heads one block handles (a larger GQA group is spread over blocks;
// each block then re-reads the split, mostly from L2).
constexpr int kMaxHeadsPerBlock = 8;
// Each warp streams its own tiles of K and V rows through a ring of kStages
// shared-memory stages filled by cp.async: kStageBytes of K and as many of V
// per stage, so kStages - 1 tiles (12 KB per warp with the values below) are
// in flight while the warp computes on one. Register loads could not keep
// enough bytes in flight to cover HBM latency at full bandwidth.
constexpr int kStageBytes = 2048;
constexpr int kStages = 3;
constexpr int kStageVecs = kStageBytes / 16;               // 16-byte chunks per stage and tensor
constexpr int kRingBytes = kDecodeWarps * kStages * 2 * kStageBytes;
// The ring, then the cache slot of each token of the split (int32: the
// handler rejects caches of 2^31 slots or more). The split kernels keep all
// their shared memory in this dynamic buffer: 16-80 bytes of static
// __shared__ variables beside it made the bf16 kernel 12-25% slower on the
// H200 with the same registers (run 15.3, benchmarks/RESULTS.md).
constexpr int kDecodeSmem = kRingBytes + kDecodeMaxSplitTokens * static_cast<int>(sizeof(int32_t));
static_assert((kDecodeMaxSplitTokens + 1) * 4 <= kRingBytes, "a split's page ids fit the ring");

// Lane layout of a warp over K/V rows of D elements of type T: kVec elements
// per 16-byte chunk, kTpt lanes per token (a power of two <= 32), kCpl chunks
// (kEpl elements) per lane, kTpp tokens per pass of the warp, kTile tokens per
// stage (kPasses passes).
template <typename T, int D>
struct RowLayout {
  static constexpr int kVec = 16 / sizeof(T);
  static constexpr int kChunks = D / kVec;
  static constexpr int kTpt = kChunks < 32 ? kChunks : 32;
  static constexpr int kCpl = kChunks / kTpt;
  static constexpr int kEpl = kCpl * kVec;
  static constexpr int kTpp = 32 / kTpt;
  static constexpr int kTile = kStageBytes / (D * static_cast<int>(sizeof(T)));
  static constexpr int kPasses = kTile / kTpp;
  static_assert(kChunks % kTpt == 0 && (kTpt & (kTpt - 1)) == 0 && 32 % kTpt == 0, "layout");
  static_assert(kTile >= kTpp && kTile % kTpp == 0 && kDecodeSplitUnit % (4 * kTile) == 0,
                "tile");
};

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
// division, had kept the block's first K/V copies waiting on a chain of
// dependent table loads: 4.01 against 4.12-4.13 TB/s at pages of 16 (run
// 17.1, benchmarks/RESULTS.md).
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

// The split kernels' per-warp cp.async ring: copies this warp's i-th tile
// (tile warp + i * kDecodeWarps of the split: kRows token rows of kChunks
// 16-byte chunks of this kv head's K and V) into stage i % kStages of
// my_ring (kVecs chunks per stage and tensor, K then V), chunk c of row r at
// pos(r, c). Always commits a group (empty past the last tile) so that the
// caller's wait counts uniformly. Skipped tokens are zero-filled without
// reading memory.
template <int kRows, int kChunks, int kStages, int kVecs, typename T, typename Pos>
__device__ __forceinline__ void IssueTile(int i, int my_tiles, int warp, int lane, int ntok,
                                          const int32_t* slot_of, int64_t row, int64_t col,
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
      const int64_t off = slot >= 0 ? slot * row + col + c * kVec : 0;
      const int bytes = slot >= 0 ? 16 : 0;
      CpAsync16Zfill(dk + pos(r, c), kc + off, bytes);
      CpAsync16Zfill(dk + kVecs + pos(r, c), vc + off, bytes);
    }
  }
  CpAsyncCommit();
}

// Merges the warps' softmax states, staged in shared memory as red[warp][row][D]
// (unnormalised outputs), wm[warp][row] (running max; base 2 when kBase2) and
// wsum[warp][row] (running sum), in warp order, and writes the split's partial
// output and (max in natural log, sum) for the block's ng query heads.
template <int kRows, int D, bool kBase2>
__device__ __forceinline__ void StoreSplit(const float* red, const float* wm, const float* wsum,
                                           const SplitBlock& blk, int64_t hq, int64_t num_splits,
                                           float* __restrict__ part_out,
                                           float* __restrict__ part_stats) {
  for (int idx = threadIdx.x; idx < blk.ng * D; idx += kDecodeThreads) {
    const int r = idx / D, e = idx % D;
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
    part_out[part * D + e] = acc;
    if (e == 0) {
      part_stats[part * 2] = kBase2 ? mx * 0.6931471805599453f : mx;  // the combine's base e
      part_stats[part * 2 + 1] = sum;
    }
  }
}

// grid (batch * hkv * head_chunks, num_splits), kDecodeThreads threads,
// kDecodeSmem bytes of dynamic shared memory. A block takes GC query heads of
// one GQA group (h0 .. h0 + ng - 1, all reading kv head kvh) over one split of
// split tokens, so K and V are read once per block, not once per head. The
// split's tiles of kTile tokens go round-robin to the warps; each warp keeps
// an online softmax (running max m, sum l, unnormalised output) per head over
// its tiles, and the warps are merged in warp order at the end. Per head the
// block writes the split's max M and sum L of exp(score - M) (part_stats) and
// the unnormalised sum of exp(score - M) * V (part_out). All sums run in a
// fixed order (bitwise reproducible run to run).
template <DType DT, int D, int GC>
__global__ void __launch_bounds__(kDecodeThreads)
    DecodeSplitKernel(const typename DevScalar<DT>::T* __restrict__ q,
                      const typename DevScalar<DT>::T* __restrict__ kc,
                      const typename DevScalar<DT>::T* __restrict__ vc,
                      const int32_t* __restrict__ table, const int32_t* __restrict__ lengths,
                      int64_t hq, int64_t hkv, int64_t group, int64_t head_chunks,
                      int64_t num_pages, int64_t page_size, int64_t max_pages,
                      int64_t num_splits, int split, float scale,
                      float* __restrict__ part_out, float* __restrict__ part_stats) {
  using S = DevScalar<DT>;
  using T = typename S::T;
  using L = RowLayout<T, D>;
  constexpr int kVec = L::kVec, kTpt = L::kTpt, kCpl = L::kCpl, kEpl = L::kEpl;
  constexpr int kTpp = L::kTpp, kTile = L::kTile, kPasses = L::kPasses, kChunks = L::kChunks;
  static_assert(kDecodeWarps * GC * (D + 2) * 4 <= kRingBytes, "merge buffer fits the ring");
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [warp][stage][K | V][kStageVecs]
  int32_t* slot_of = reinterpret_cast<int32_t*>(smem + kRingBytes);  // -1: skipped token

  const int tid = threadIdx.x;
  const int warp = tid / 32, wl = tid % 32;
  const int lane = wl % kTpt;  // lane within its token
  const int tg = wl / kTpt;    // token of the pass
  SplitBlock blk;
  if (!SetupSplit(blk, GC, table, lengths, hkv, group, head_chunks, num_pages, page_size,
                  max_pages, split, reinterpret_cast<int32_t*>(smem), slot_of))
    return;
  const int64_t b = blk.b, h0 = blk.h0;
  const int ntok = blk.ntok, ng = blk.ng;
  const int64_t row = hkv * D;      // elements per cache slot
  const int64_t col = blk.kvh * D;  // this kv head's offset within a slot

  // This lane's elements of q * scale for each head (0 for heads past ng).
  float qr[GC][kEpl];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
#pragma unroll
    for (int c = 0; c < kCpl; ++c) {
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (g < ng)
        raw = __ldg(reinterpret_cast<const uint4*>(q + (b * hq + h0 + g) * D +
                                                   (c * kTpt + lane) * kVec));
      float f[kVec];
      Unpack<DT>(raw, f);
#pragma unroll
      for (int x = 0; x < kVec; ++x) qr[g][c * kVec + x] = f[x] * scale;
    }
  }
  __syncthreads();  // slot_of visible

  const int my_tiles = WarpTiles(ntok, kTile, warp);
  uint4* my_ring = ring + warp * kStages * 2 * kStageVecs;
  auto issue = [&](int i) {  // rows stored unswizzled: chunk c of row r at r * kChunks + c
    IssueTile<kTile, kChunks, kStages, kStageVecs>(i, my_tiles, warp, wl, ntok, slot_of, row, col,
                                                   kc, vc, my_ring,
                                                   [](int r, int c) { return r * kChunks + c; });
  };

  float m[GC], lsum[GC], acc[GC][kEpl];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
    m[g] = -INFINITY;
    lsum[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kEpl; ++e) acc[g][e] = 0.f;
  }

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  for (int i = 0; i < my_tiles; ++i) {  // uniform over the warp
    issue(i + kStages - 1);
    CpAsyncWait<kStages - 1>();  // this lane's copies of tile i landed ...
    __syncwarp();                // ... and every lane's are visible
    const uint4* sk = my_ring + (i % kStages) * 2 * kStageVecs;
    const uint4* sv = sk + kStageVecs;
    const int base = (warp + i * kDecodeWarps) * kTile;

    // Scores of the tile's tokens: partial dots over this lane's chunks,
    // summed over the token's kTpt lanes (each of them gets the sum).
    float s[kPasses][GC];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
#pragma unroll
      for (int g = 0; g < GC; ++g) s[p][g] = 0.f;
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
        float f[kVec];
        Unpack<DT>(sk[(p * kTpp + tg) * kChunks + c * kTpt + lane], f);
#pragma unroll
        for (int g = 0; g < GC; ++g) {
#pragma unroll
          for (int x = 0; x < kVec; ++x) s[p][g] += qr[g][c * kVec + x] * f[x];
        }
      }
    }
#pragma unroll
    for (int o = kTpt / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
#pragma unroll
        for (int g = 0; g < GC; ++g) s[p][g] += __shfl_xor_sync(0xffffffffu, s[p][g], o);
      }
    }
    bool ok[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int tok = base + p * kTpp + tg;
      ok[p] = tok < ntok && slot_of[tok] >= 0;
    }
    // Online softmax per head: the tile's max over the warp (exact, so the
    // same in every lane), rescale the running sums when it grows, then
    // scores become exp(s - m), 0 for skipped tokens.
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      float mt = -INFINITY;
#pragma unroll
      for (int p = 0; p < kPasses; ++p) mt = ok[p] ? fmaxf(mt, s[p][g]) : mt;
#pragma unroll
      for (int o = kTpt; o < 32; o <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float mn = fmaxf(m[g], mt);
      if (mn > m[g]) {  // warp-uniform; m[g] == -INF: nothing to rescale yet
        const float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - mn);
        lsum[g] *= alpha;
#pragma unroll
        for (int e = 0; e < kEpl; ++e) acc[g][e] *= alpha;
        m[g] = mn;
      }
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        s[p][g] = ok[p] ? expf(s[p][g] - m[g]) : 0.f;
        lsum[g] += s[p][g];
      }
    }
    // Output: each lane adds p * V over its token of every pass.
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
        float f[kVec];
        Unpack<DT>(sv[(p * kTpp + tg) * kChunks + c * kTpt + lane], f);
#pragma unroll
        for (int g = 0; g < GC; ++g) {
#pragma unroll
          for (int x = 0; x < kVec; ++x) acc[g][c * kVec + x] += s[p][g] * f[x];
        }
      }
    }
    __syncwarp();  // every lane done with stage i % kStages before it is refilled
  }
  CpAsyncWait<0>();  // only empty groups remain; nothing may land after the merge starts

  // Sum over the warp's tokens of a pass (xor over token lanes), then merge
  // the warps through shared memory (the ring is free), in warp order.
#pragma unroll
  for (int o = kTpt; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      lsum[g] += __shfl_xor_sync(0xffffffffu, lsum[g], o);
#pragma unroll
      for (int e = 0; e < kEpl; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  __syncthreads();  // every warp is out of the ring
  float* red = reinterpret_cast<float*>(smem);       // [warp][GC][D]
  float* wm = red + kDecodeWarps * GC * D;           // [warp][GC]: running max
  float* wsum = wm + kDecodeWarps * GC;              // [warp][GC]: running sum
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < GC; ++g) {
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
#pragma unroll
        for (int x = 0; x < kVec; ++x)
          red[(warp * GC + g) * D + (c * kTpt + lane) * kVec + x] = acc[g][c * kVec + x];
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < GC; ++g) {
        wm[warp * GC + g] = m[g];
        wsum[warp * GC + g] = lsum[g];
      }
    }
  }
  __syncthreads();
  PdlTrigger();  // the combine may launch once every block is this far (it waits for the writes)
  StoreSplit<GC, D, false>(red, wm, wsum, blk, hq, num_splits, part_out, part_stats);
}

// ---- bf16 / f16: tensor cores --------------------------------------------------
//
// The same split as DecodeSplitKernel, with both products on mma.sync
// m16n8k16 and the query heads on the n side (8 of them), so that no
// accumulator is spent on rows a GQA group does not have: per warp tile of 16
// tokens, S^T (16 tokens x 8 heads) = K q^T, then O^T (D x 8 heads) += V^T P^T
// with P rounded to the input type. P goes from the accumulator layout of S^T
// to the B operand layout through 256 bytes of shared memory per warp. K/V
// tiles stream through a per-warp cp.async ring, rows stored with 16-byte
// chunks XOR-swizzled by row so that ldmatrix is free of bank conflicts.
constexpr int kMmaRows = 8;     // query heads per block (the mma's n)
constexpr int kMmaTokens = 16;  // tokens per warp tile

template <int D>
struct MmaDecode {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per K/V row
  // Two stages (one tile in flight while the warp computes on the other)
  // keep the ring small enough for 3 blocks per SM at D = 128.
  static constexpr int kStages = D > 64 ? 2 : 3;
  static constexpr int kTileVecs = kMmaTokens * kChunks;  // chunks per tile and tensor
  static constexpr int kRingBytes = kDecodeWarps * kStages * 2 * kTileVecs * 16;
  static constexpr int kPBytes = kMmaTokens * kMmaRows * 2;  // P of one warp, [token][head]
  static constexpr int kFixedBytes = kRingBytes + kDecodeWarps * kPBytes;  // before slot_of
  static constexpr int kSmem =
      kFixedBytes + kDecodeMaxSplitTokens * static_cast<int>(sizeof(int32_t));
  static constexpr int kKSteps = D / 16;  // k steps of K q^T
  static constexpr int kMTiles = D / 16;  // m tiles of V^T P^T
  static_assert(kChunks >= 8 && kTileVecs % 32 == 0 &&
                    kDecodeSplitUnit % (kDecodeWarps * kMmaTokens) == 0, "layout");
  static_assert(kDecodeWarps * kMmaRows * (D + 2) * 4 <= kRingBytes, "merge fits the ring");
  static_assert((kDecodeMaxSplitTokens + 1) * 4 <= kRingBytes, "page ids fit the ring");
};

// Position of chunk c of row r in a tile: XOR-swizzled over 8 rows.
template <int kChunks>
__device__ __forceinline__ int Swz(int r, int c) {
  return r * kChunks + (c ^ (r & 7));
}

template <DType DT, int D>
__global__ void __launch_bounds__(kDecodeThreads)
    DecodeSplitMmaKernel(const typename DevScalar<DT>::T* __restrict__ q,
                         const typename DevScalar<DT>::T* __restrict__ kc,
                         const typename DevScalar<DT>::T* __restrict__ vc,
                         const int32_t* __restrict__ table, const int32_t* __restrict__ lengths,
                         int64_t hq, int64_t hkv, int64_t group, int64_t head_chunks,
                         int64_t num_pages, int64_t page_size, int64_t max_pages,
                         int64_t num_splits, int split, float scale,
                         float* __restrict__ part_out, float* __restrict__ part_stats) {
  using T = typename DevScalar<DT>::T;
  using C = MmaDecode<D>;
  constexpr int kChunks = C::kChunks, kStages = C::kStages, kTileVecs = C::kTileVecs;
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [warp][stage][K | V][kTileVecs]
  int32_t* slot_of = reinterpret_cast<int32_t*>(smem + C::kFixedBytes);  // -1: skipped token

  const int tid = threadIdx.x;
  const int warp = tid / 32, wl = tid % 32;
  const int g = wl / 4, t = wl % 4;  // mma fragment coordinates
  SplitBlock blk;
  if (!SetupSplit(blk, kMmaRows, table, lengths, hkv, group, head_chunks, num_pages, page_size,
                  max_pages, split, reinterpret_cast<int32_t*>(smem), slot_of))
    return;
  const int64_t b = blk.b, h0 = blk.h0;
  const int ntok = blk.ntok, ng = blk.ng;
  const int64_t row = hkv * D;      // elements per cache slot
  const int64_t col = blk.kvh * D;  // this kv head's offset within a slot
  // This warp's P buffer: 16 rows (tokens) of 8 heads, 16 bytes each.
  unsigned char* pbuf = smem + C::kRingBytes + warp * C::kPBytes;

  // q as the B operand of K q^T: column n = query head h0 + g (0 past the
  // chunk's heads), rows 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16-wide k step.
  uint32_t qb[C::kKSteps][2];
  {
    const bool ok = g < ng;
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + (b * hq + h0 + (ok ? g : 0)) * D);
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      qb[ks][0] = ok ? __ldg(qr + 8 * ks + t) : 0u;
      qb[ks][1] = ok ? __ldg(qr + 8 * ks + 4 + t) : 0u;
    }
  }
  __syncthreads();  // slot_of visible

  const int my_tiles = WarpTiles(ntok, kMmaTokens, warp);
  uint4* my_ring = ring + warp * kStages * 2 * kTileVecs;
  auto issue = [&](int i) {  // rows XOR-swizzled for ldmatrix
    auto pos = [](int r, int c) { return Swz<kChunks>(r, c); };
    IssueTile<kMmaTokens, kChunks, kStages, kTileVecs>(i, my_tiles, warp, wl, ntok, slot_of, row,
                                                       col, kc, vc, my_ring, pos);
  };

  // Running softmax state of heads 2t (h = 0) and 2t + 1 (h = 1); o[j] holds
  // rows (d) 16j + g and 16j + g + 8 of both heads (the accumulator layout).
  float o[C::kMTiles][4];
#pragma unroll
  for (int j = 0; j < C::kMTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int mi = wl / 8, mr = wl % 8;  // the ldmatrix matrix and row this lane addresses
  const float scale2 = scale * 1.4426950408889634f;  // scale * log2(e)

#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  for (int i = 0; i < my_tiles; ++i) {  // uniform over the warp
    issue(i + kStages - 1);
    CpAsyncWait<kStages - 1>();  // this lane's copies of tile i landed ...
    __syncwarp();                // ... and every lane's are visible
    const uint4* sk = my_ring + (i % kStages) * 2 * kTileVecs;
    const uint4* sv = sk + kTileVecs;
    const int base = (warp + i * kDecodeWarps) * kMmaTokens;

    // S^T = K q^T: s holds tokens g (0, 1) and g + 8 (2, 3) of heads 2t, 2t + 1.
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      uint32_t ka[4];  // matrices: tokens 0-7 / 8-15 (mi % 2) x d chunk 2ks / 2ks + 1 (mi / 2)
      Ldmatrix4(ka, sk + Swz<kChunks>((mi & 1) * 8 + mr, 2 * ks + (mi >> 1)));
      Mma16816<T>(s, ka, qb[ks][0], qb[ks][1]);
    }
    // Online softmax per head, in base 2 (scores times scale * log2(e)):
    // skipped tokens -inf; the tile's max over the 8 lanes of a head pair.
    const bool ok0 = base + g < ntok && slot_of[base + g] >= 0;
    const bool ok1 = base + g + 8 < ntok && slot_of[base + g + 8] >= 0;
    s[0] = ok0 ? s[0] * scale2 : -INFINITY;
    s[1] = ok0 ? s[1] * scale2 : -INFINITY;
    s[2] = ok1 ? s[2] * scale2 : -INFINITY;
    s[3] = ok1 ? s[3] * scale2 : -INFINITY;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mt = fmaxf(s[h], s[2 + h]);
#pragma unroll
      for (int x = 4; x < 32; x <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, x));
      const float mn = fmaxf(m[h], mt);
      alpha[h] = mn == m[h] ? 1.f : exp2f(m[h] - mn);  // m = -inf: 2^-inf = 0
      m[h] = mn;
      l[h] *= alpha[h];
    }
    // Rescale the outputs only when some head's max grew (rare after the
    // first tiles): a warp-uniform branch.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < C::kMTiles; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[1];
        o[j][2] *= alpha[0];
        o[j][3] *= alpha[1];
      }
    }
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = s[e] == -INFINITY ? 0.f : exp2f(s[e] - m[e & 1]);
      l[e & 1] += p[e];
    }
    // P^T as the B operand of V^T P^T: through shared memory as [token][head]
    // (the accumulator gives each lane two heads of a token; the operand
    // wants two tokens of a head), then ldmatrix.trans.
    uint32_t* p32 = reinterpret_cast<uint32_t*>(pbuf);
    p32[g * 4 + t] = PackFloat2<T>(p[0], p[1]);
    p32[(g + 8) * 4 + t] = PackFloat2<T>(p[2], p[3]);
    __syncwarp();
    uint32_t pb[2];
    Ldmatrix2Trans(pb, pbuf + (wl % 16) * 16);
    // O^T += V^T P^T.
#pragma unroll
    for (int j = 0; j < C::kMTiles; ++j) {
      uint32_t va[4];  // matrices: tokens 0-7 / 8-15 (mi / 2) x d chunk 2j / 2j + 1 (mi % 2)
      Ldmatrix4Trans(va, sv + Swz<kChunks>((mi >> 1) * 8 + mr, 2 * j + (mi & 1)));
      Mma16816<T>(o[j], va, pb[0], pb[1]);
    }
    __syncwarp();  // every lane done with stage i % kStages and pbuf before they are refilled
  }
  CpAsyncWait<0>();  // only empty groups remain; nothing may land after the merge starts

  // Head sums over the 8 lanes of a head pair, then merge the warps through
  // shared memory (the ring is free), in warp order.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
  }
  __syncthreads();  // every warp is out of the ring
  float* red = reinterpret_cast<float*>(smem);    // [warp][head][D]
  float* wm = red + kDecodeWarps * kMmaRows * D;  // [warp][head]: running max
  float* wsum = wm + kDecodeWarps * kMmaRows;     // [warp][head]: running sum
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* dst = red + (warp * kMmaRows + 2 * t + h) * D + g;
#pragma unroll
    for (int j = 0; j < C::kMTiles; ++j) {
      dst[16 * j] = o[j][h];
      dst[16 * j + 8] = o[j][2 + h];
    }
    if (g == 0) {
      wm[warp * kMmaRows + 2 * t + h] = m[h];
      wsum[warp * kMmaRows + 2 * t + h] = l[h];
    }
  }
  __syncthreads();
  PdlTrigger();  // the combine may launch once every block is this far (it waits for the writes)
  StoreSplit<kMmaRows, D, true>(red, wm, wsum, blk, hq, num_splits, part_out, part_stats);
}

constexpr int kCombineWarps = 4;  // one (sequence, query head) per warp
constexpr int kCombineThreads = 32 * kCombineWarps;
constexpr int kCombineBatch = 8;  // partial outputs in flight per lane (divides 32)

// grid (ceil(rows / kCombineWarps)), kCombineThreads threads; warp w of the
// block merges row bh = batch * hq + head (bh < rows): out = sum_s w_s o_s /
// sum_s w_s l_s over the splits holding tokens, w_s = exp(m_s - max_s m_s);
// no valid token: 0. Lane l holds elements l * D / 32 .. of every partial
// output and adds the splits in split order; the weights of 32 splits are
// computed one per lane and broadcast by shuffle. No shared memory and no
// block barrier: a length, the stats, then the partial outputs
// kCombineBatch splits at a time. Sums run in a fixed order (bitwise
// reproducible run to run).
template <DType DT, int D>
__global__ void __launch_bounds__(kCombineThreads)
    DecodeCombineKernel(const float* __restrict__ part_out, const float* __restrict__ part_stats,
                        const int32_t* __restrict__ lengths, int64_t hq, int64_t rows,
                        int64_t max_tokens, int64_t num_splits, int64_t split,
                        typename DevScalar<DT>::T* __restrict__ out) {
  using S = DevScalar<DT>;
  constexpr int kE = D / 32;  // elements per lane
  static_assert(D % 32 == 0 && (kE == 2 || kE % 4 == 0), "combine layout");
  PdlWait();  // launched with PDL: the split kernel's partials
  const int lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.x * int64_t{kCombineWarps} + threadIdx.x / 32;
  if (bh >= rows) return;  // warp-uniform
  const int64_t len = ClampLength(lengths[bh / hq], max_tokens);
  int64_t used = (len + split - 1) / split;  // splits holding tokens
  if (used > num_splits) used = num_splits;
  const float* st = part_stats + bh * num_splits * 2;
  const float* po = part_out + bh * num_splits * D + lane * kE;

  float mx = -INFINITY;
  for (int64_t s = lane; s < used; s += 32) mx = fmaxf(mx, st[2 * s]);
  mx = WarpMax(mx);
  float acc[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) acc[e] = 0.f;
  float den = 0.f;
  for (int64_t c0 = 0; c0 < used; c0 += 32) {
    float ws = 0.f;  // the weight of split c0 + lane
    if (c0 + lane < used) {
      const float ms = st[2 * (c0 + lane)];
      ws = ms == -INFINITY ? 0.f : expf(ms - mx);  // a split without valid token: 0
      den += ws * st[2 * (c0 + lane) + 1];
    }
    // Eight partial outputs are loaded before any is added, so that a row
    // of many splits costs a few memory round trips, not one per split.
    // Past the last split the loads are skipped and the weight is 0.
    const int n = static_cast<int>(used - c0 < 32 ? used - c0 : 32);
    for (int j0 = 0; j0 < n; j0 += kCombineBatch) {
      float x[kCombineBatch][kE];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const float* row = po + (c0 + j0 + u) * D;
        const bool live = j0 + u < n;
        if constexpr (kE == 2) {
          const float2 v = live ? *reinterpret_cast<const float2*>(row) : make_float2(0.f, 0.f);
          x[u][0] = v.x;
          x[u][1] = v.y;
        } else {
#pragma unroll
          for (int q = 0; q < kE / 4; ++q) {
            const float4 v = live ? reinterpret_cast<const float4*>(row)[q]
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
            x[u][4 * q] = v.x;
            x[u][4 * q + 1] = v.y;
            x[u][4 * q + 2] = v.z;
            x[u][4 * q + 3] = v.w;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const float wj = __shfl_sync(0xffffffffu, ws, j0 + u);  // 0 past the last split
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[e] += wj * x[u][e];
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  auto* dst = out + bh * D + lane * kE;
#pragma unroll
  for (int e = 0; e < kE; ++e) dst[e] = S::Store(den > 0.f ? acc[e] / den : 0.f);
}

// Launches a split kernel on a grid of (batch x kv heads x chunks of `rows`
// query heads, splits) with ring_bytes + 4 bytes per split token of dynamic
// shared memory (opted in up to max_smem), then the combine kernel.
template <DType DT, int D, auto Kernel>
ffi::Error LaunchDecode(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& kp,
                        const ffi::AnyBuffer& vp, const int32_t* table, const int32_t* lengths,
                        const DecodeDims& d, float scale, void* out, float* part_out,
                        float* part_stats, int rows, int ring_bytes, int max_smem) {
  using T = typename DevScalar<DT>::T;
  const int64_t head_chunks = (d.group + rows - 1) / rows;
  const int64_t blocks = d.batch * d.hkv * head_chunks;
  if (blocks >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: batch * kv heads * head chunks must be < 2^31");
  // The chunks of one (sequence, kv head) are neighbours on grid.x: they run
  // together and share the split's K/V through L2.
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(d.num_splits));
  if (EnsureDynamicSmem<Kernel>(max_smem) != cudaSuccess)
    return LastCudaError("paged_decode shared memory opt-in");
  const int split = static_cast<int>(d.split_tokens);
  const int smem = ring_bytes + split * static_cast<int>(sizeof(int32_t));
  Kernel<<<grid, kDecodeThreads, smem, stream>>>(
      static_cast<const T*>(q.untyped_data()), static_cast<const T*>(kp.untyped_data()),
      static_cast<const T*>(vp.untyped_data()), table, lengths, d.hq, d.hkv, d.group,
      head_chunks, d.num_pages, d.page_size, d.max_pages, d.num_splits, split, scale, part_out,
      part_stats);
  if (auto err = LastCudaError("paged_decode split launch"); err.failure()) return err;
  const int64_t out_rows = d.batch * d.hq;
  // With PDL (sm_90+) the combine's blocks are resident when the split
  // kernel's last blocks finish.
  return CudaError(
      LaunchKernel(DecodeCombineKernel<DT, D>, CeilDiv(out_rows, kCombineWarps), kCombineThreads,
                   0, stream, DeviceMajor() >= 9, static_cast<const float*>(part_out),
                   static_cast<const float*>(part_stats), lengths, d.hq, out_rows, d.max_tokens,
                   d.num_splits, d.split_tokens, static_cast<T*>(out)),
      "paged_decode combine launch");
}

template <DType DT, int D, int GC>
ffi::Error LaunchDecodeSimt(cudaStream_t stream, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& kp, const ffi::AnyBuffer& vp,
                            const int32_t* table, const int32_t* lengths, const DecodeDims& d,
                            float scale, void* out, float* part_out, float* part_stats) {
  return LaunchDecode<DT, D, DecodeSplitKernel<DT, D, GC>>(
      stream, q, kp, vp, table, lengths, d, scale, out, part_out, part_stats, GC, kRingBytes,
      kDecodeSmem);
}

// bf16/f16 run the tensor-core kernel (8 heads per block). f32 runs the
// SIMT kernel with heads per block the smallest power of two covering the
// group, at most kMaxHeadsPerBlock (registers hold GC x (elements per lane) of
// q and of the output; a non power of two leaves the last heads idle).
template <DType DT, int D>
ffi::Error DispatchDecode(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& kp,
                          const ffi::AnyBuffer& vp, const int32_t* table, const int32_t* lengths,
                          const DecodeDims& d, float scale, void* out, float* part_out,
                          float* part_stats) {
  static_assert(kMaxHeadsPerBlock == 8, "dispatch below");
  if constexpr (DT != DType::F32) {  // 16-bit types: the tensor-core kernel
    return LaunchDecode<DT, D, DecodeSplitMmaKernel<DT, D>>(
        stream, q, kp, vp, table, lengths, d, scale, out, part_out, part_stats, kMmaRows,
        MmaDecode<D>::kFixedBytes, MmaDecode<D>::kSmem);
  } else {
    if (d.group <= 1)
      return LaunchDecodeSimt<DT, D, 1>(stream, q, kp, vp, table, lengths, d, scale, out,
                                        part_out, part_stats);
    if (d.group <= 2)
      return LaunchDecodeSimt<DT, D, 2>(stream, q, kp, vp, table, lengths, d, scale, out,
                                        part_out, part_stats);
    if (d.group <= 4)
      return LaunchDecodeSimt<DT, D, 4>(stream, q, kp, vp, table, lengths, d, scale, out,
                                        part_out, part_stats);
    return LaunchDecodeSimt<DT, D, 8>(stream, q, kp, vp, table, lengths, d, scale, out,
                                      part_out, part_stats);
  }
}

ffi::Error PagedDecodeCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_table,
                           ffi::Buffer<ffi::S32> lengths, float scale, int64_t split_tokens,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_out,
                           ffi::Result<ffi::Buffer<ffi::F32>> part_stats) {
  DecodeDims d;
  if (auto err = CheckDecode(q, k_pages, v_pages, page_table, lengths, *out, *part_out,
                             *part_stats, split_tokens, &d);
      err.failure())
    return err;
  if (d.batch == 0 || d.hq == 0) return ffi::Error::Success();
  if (d.num_splits > 65535) return InvalidArg("paged_decode: max_pages * page_size too large");
  if (d.num_pages * d.page_size >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: the cache must have fewer than 2^31 slots");
  if (d.batch * d.hkv >= (int64_t{1} << 31) || d.batch * d.hq >= (int64_t{1} << 31))
    return InvalidArg("paged_decode: batch * heads must be < 2^31");
  return DispatchFloat(q.element_type(), "q", [&]<DType DT>() {
    const auto* table = page_table.typed_data();
    const auto* lens = lengths.typed_data();
    float* po = part_out->typed_data();
    float* ps = part_stats->typed_data();
    switch (d.head_dim) {
      case 64:
        return DispatchDecode<DT, 64>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                      out->untyped_data(), po, ps);
      case 128:
        return DispatchDecode<DT, 128>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                       out->untyped_data(), po, ps);
      default:
        return DispatchDecode<DT, 256>(stream, q, k_pages, v_pages, table, lens, d, scale,
                                       out->untyped_data(), po, ps);
    }
  });
}

// ---- fill_rows ------------------------------------------------------------------

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
ffi::Error LaunchFillRows(cudaStream_t stream, void* x, const int32_t* ctrl, int64_t rows,
                          int64_t row_bytes, Unit zero, Unit nan) {
  const int64_t units = row_bytes / static_cast<int64_t>(sizeof(Unit));
  FillRowsKernel<Unit><<<GridFor(rows * units, 256, 1024), 256, 0, stream>>>(
      static_cast<Unit*>(x), ctrl, rows, units, zero, nan);
  return LastCudaError("fill_rows launch");
}

ffi::Error FillRowsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> ctrl,
                        ffi::Result<ffi::AnyBuffer> out) {
  int64_t rows = 0, row_bytes = 0;
  if (auto err = CheckFillRows(x, ctrl, *out, &rows, &row_bytes); err.failure()) return err;
  void* o = out->untyped_data();
  if (o != x.untyped_data() && x.size_bytes() != 0 &&
      cudaMemcpyAsync(o, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream) !=
          cudaSuccess)
    return LastCudaError("fill_rows copy");
  if (rows == 0 || row_bytes == 0) return ffi::Error::Success();
  const uint32_t nan = NanBits(x.element_type());
  if (ffi::ByteWidth(x.element_type()) == 4) {
    if (row_bytes % 16 == 0)
      return LaunchFillRows<uint4>(stream, o, ctrl.typed_data(), rows, row_bytes,
                                   make_uint4(0, 0, 0, 0), make_uint4(nan, nan, nan, nan));
    return LaunchFillRows<uint32_t>(stream, o, ctrl.typed_data(), rows, row_bytes, 0u, nan);
  }
  const uint32_t nan2 = nan | (nan << 16);  // two 16-bit NaNs
  if (row_bytes % 16 == 0)
    return LaunchFillRows<uint4>(stream, o, ctrl.typed_data(), rows, row_bytes,
                                 make_uint4(0, 0, 0, 0), make_uint4(nan2, nan2, nan2, nan2));
  if (row_bytes % 4 == 0)
    return LaunchFillRows<uint32_t>(stream, o, ctrl.typed_data(), rows, row_bytes, 0u, nan2);
  return LaunchFillRows<uint16_t>(stream, o, ctrl.typed_data(), rows, row_bytes, uint16_t{0},
                                  static_cast<uint16_t>(nan));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kFillRowsCuda, FillRowsCuda,
    FillRowsSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kWriteKvCuda, WriteKvCuda,
    WriteKvSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kPagedDecodeCuda, PagedDecodeCuda,
    PagedDecodeSignature(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_moe
