// The bf16 / f16 split kernel of paged decode (tensor cores; f32 runs the
// SIMT kernel of decode_split_simt.cu) and its launcher.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "kernels/common/attention.h"
#include "kernels/common/numeric.h"
#include "kernels/cuda/attention/decode_common.cuh"
#include "kernels/cuda/cuda_common.cuh"

namespace jax_moe {
namespace {

// The same split as the SIMT DecodeSplitKernel (decode_split_simt.cu), with
// both products on mma.sync m16n8k16 and the query heads on the n side (8 of
// them), so that no accumulator is spent on rows a GQA group does not have:
// per warp tile of 16 tokens, S^T (16 tokens x 8 heads) = K q^T, then O^T
// (D x 8 heads) += V^T P^T with P rounded to the input type. P goes from the
// accumulator layout of S^T to the B operand layout through 256 bytes of
// shared memory per warp. K/V tiles stream through a per-warp cp.async ring,
// rows stored with 16-byte chunks XOR-swizzled by row so that ldmatrix is
// free of bank conflicts. Compiled for head dim D, it serves K and V head
// dims dk, dv <= D (multiples of 8) with q, K and V zero past their own dims
// (see the SIMT kernel).
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
                         int64_t num_splits, int split, int dk, int dv, float scale,
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
  const CacheRows rows{hkv, blk.kvh, dk, dv, dk / 8, dv / 8};
  // This warp's P buffer: 16 rows (tokens) of 8 heads, 16 bytes each.
  unsigned char* pbuf = smem + C::kRingBytes + warp * C::kPBytes;

  // q as the B operand of K q^T: column n = query head h0 + g (0 past the
  // chunk's heads), rows 2t, 2t + 1 and 2t + 8, 2t + 9 of each 16-wide k step
  // (0 past dk, a multiple of 8: a pair never straddles it).
  uint32_t qb[C::kKSteps][2];
  {
    const bool ok = g < ng;
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + (b * hq + h0 + (ok ? g : 0)) * dk);
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      qb[ks][0] = ok && 16 * ks + 2 * t < dk ? __ldg(qr + 8 * ks + t) : 0u;
      qb[ks][1] = ok && 16 * ks + 8 + 2 * t < dk ? __ldg(qr + 8 * ks + 4 + t) : 0u;
    }
  }
  __syncthreads();  // slot_of visible

  const int my_tiles = WarpTiles(ntok, kMmaTokens, warp);
  uint4* my_ring = ring + warp * kStages * 2 * kTileVecs;
  auto issue = [&](int i) {  // rows XOR-swizzled for ldmatrix
    auto pos = [](int r, int c) { return Swz<kChunks>(r, c); };
    IssueTile<kMmaTokens, kChunks, kStages, kTileVecs>(i, my_tiles, warp, wl, ntok, slot_of,
                                                       rows, kc, vc, my_ring, pos);
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
  StoreSplit<kMmaRows, D, true>(red, wm, wsum, blk, hq, num_splits, dv, part_out, part_stats);
}

template <DType DT>
cudaError_t DispatchDecodeMma(cudaStream_t stream, const DecodeDims& d, const void* q,
                              const void* kp, const void* vp, const int32_t* table,
                              const int32_t* lengths, float scale, float* part_out,
                              float* part_stats) {
  switch (DecodeTileDim(d.k_dim > d.v_dim ? d.k_dim : d.v_dim)) {
    case 64:
      return LaunchSplit<DT, DecodeSplitMmaKernel<DT, 64>>(
          stream, d, q, kp, vp, table, lengths, scale, part_out, part_stats, kMmaRows,
          MmaDecode<64>::kFixedBytes, MmaDecode<64>::kSmem);
    case 128:
      return LaunchSplit<DT, DecodeSplitMmaKernel<DT, 128>>(
          stream, d, q, kp, vp, table, lengths, scale, part_out, part_stats, kMmaRows,
          MmaDecode<128>::kFixedBytes, MmaDecode<128>::kSmem);
    default:
      return LaunchSplit<DT, DecodeSplitMmaKernel<DT, 256>>(
          stream, d, q, kp, vp, table, lengths, scale, part_out, part_stats, kMmaRows,
          MmaDecode<256>::kFixedBytes, MmaDecode<256>::kSmem);
  }
}

}  // namespace

cudaError_t LaunchDecodeSplitMma(cudaStream_t stream, DType dtype, const DecodeDims& d,
                                 const void* q, const void* k_pages, const void* v_pages,
                                 const int32_t* page_table, const int32_t* lengths, float scale,
                                 float* part_out, float* part_stats) {
  switch (dtype) {
    case DType::BF16:
      return DispatchDecodeMma<DType::BF16>(stream, d, q, k_pages, v_pages, page_table, lengths,
                                            scale, part_out, part_stats);
    case DType::F16:
      return DispatchDecodeMma<DType::F16>(stream, d, q, k_pages, v_pages, page_table, lengths,
                                           scale, part_out, part_stats);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace jax_moe
