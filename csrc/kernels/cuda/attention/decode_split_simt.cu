// The f32 split kernel of paged decode (SIMT; bf16 / f16 run the tensor-core
// kernel of decode_split_mma.cu) and its launcher.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/attention/decode_common.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

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
// their shared memory in this dynamic buffer: a few static __shared__
// variables beside it measured slower on the H200 with the same registers
// (see docs/performance.md).
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

// grid (batch * hkv * head_chunks, num_splits), kDecodeThreads threads,
// kDecodeSmem bytes of dynamic shared memory. Compiled for head dim D, it
// serves K head dims dk <= D and V head dims dv <= D (multiples of 8): q and
// the K/V rows are zero past their own dims, so the scores are exact and the
// output's elements past dv are 0 (not stored). A block takes GC query heads of
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
                      int64_t num_splits, int split, int dk, int dv, float scale,
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
  const CacheRows rows{hkv, blk.kvh, dk, dv, dk / kVec, dv / kVec};

  // This lane's elements of q * scale for each head (0 for heads past ng and
  // past dk).
  float qr[GC][kEpl];
#pragma unroll
  for (int g = 0; g < GC; ++g) {
#pragma unroll
    for (int c = 0; c < kCpl; ++c) {
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      const int chunk = c * kTpt + lane;
      if (g < ng && chunk < rows.k_chunks)
        raw = __ldg(reinterpret_cast<const uint4*>(q + (b * hq + h0 + g) * dk + chunk * kVec));
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
    IssueTile<kTile, kChunks, kStages, kStageVecs>(i, my_tiles, warp, wl, ntok, slot_of, rows, kc,
                                                   vc, my_ring,
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
  StoreSplit<GC, D, false>(red, wm, wsum, blk, hq, num_splits, dv, part_out, part_stats);
}

template <DType DT, int D, int GC>
cudaError_t LaunchDecodeSimt(cudaStream_t stream, const DecodeDims& d, const void* q,
                             const void* kp, const void* vp, const int32_t* table,
                             const int32_t* lengths, float scale, float* part_out,
                             float* part_stats) {
  return LaunchSplit<DT, DecodeSplitKernel<DT, D, GC>>(stream, d, q, kp, vp, table, lengths,
                                                       scale, part_out, part_stats, GC,
                                                       kRingBytes, kDecodeSmem);
}

// Heads per block: the smallest power of two covering the group, at most
// kMaxHeadsPerBlock (registers hold GC x (elements per lane) of q and of the
// output; a non power of two leaves the last heads idle).
template <int D>
cudaError_t DispatchDecodeSimt(cudaStream_t stream, const DecodeDims& d, const void* q,
                               const void* kp, const void* vp, const int32_t* table,
                               const int32_t* lengths, float scale, float* part_out,
                               float* part_stats) {
  static_assert(kMaxHeadsPerBlock == 8, "dispatch below");
  constexpr DType DT = DType::F32;
  if (d.group <= 1)
    return LaunchDecodeSimt<DT, D, 1>(stream, d, q, kp, vp, table, lengths, scale, part_out,
                                      part_stats);
  if (d.group <= 2)
    return LaunchDecodeSimt<DT, D, 2>(stream, d, q, kp, vp, table, lengths, scale, part_out,
                                      part_stats);
  if (d.group <= 4)
    return LaunchDecodeSimt<DT, D, 4>(stream, d, q, kp, vp, table, lengths, scale, part_out,
                                      part_stats);
  return LaunchDecodeSimt<DT, D, 8>(stream, d, q, kp, vp, table, lengths, scale, part_out,
                                    part_stats);
}

}  // namespace

cudaError_t LaunchDecodeSplitSimt(cudaStream_t stream, const DecodeDims& d, const void* q,
                                  const void* k_pages, const void* v_pages,
                                  const int32_t* page_table, const int32_t* lengths, float scale,
                                  float* part_out, float* part_stats) {
  switch (DecodeTileDim(d.k_dim > d.v_dim ? d.k_dim : d.v_dim)) {
    case 64:
      return DispatchDecodeSimt<64>(stream, d, q, k_pages, v_pages, page_table, lengths, scale,
                                    part_out, part_stats);
    case 128:
      return DispatchDecodeSimt<128>(stream, d, q, k_pages, v_pages, page_table, lengths, scale,
                                     part_out, part_stats);
    default:
      return DispatchDecodeSimt<256>(stream, d, q, k_pages, v_pages, page_table, lengths, scale,
                                     part_out, part_stats);
  }
}

}  // namespace jax_moe
