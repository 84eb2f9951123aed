// The grouped GEMM's decode kernel for tile_m = 16 on compute capability
// 9.0+ (bf16 / f16, 2-128 tokens): persistent and warp-specialised, a
// producer warp streaming the weights with the tensor memory accelerator and
// eight consumer warps multiplying them by up to 16 token rows; and its host
// launcher (the weight tensor map, the launch rule). Part of the one
// translation unit of dispatch.cu.
#pragma once

#include <cuda.h>  // CUtensorMap (types only: the encoder comes through the runtime)
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"
#include "kernels/cuda/group_gemm/tensor_map.cuh"

namespace jax_moe {
namespace {

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
  const int b_off =
      C::kXOff + ((lane & 7) + ((lane >> 4) << 3)) * C::kXPitch + ((lane >> 3) & 1) * 16;
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

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

// From this K on, the TMA kernel takes launches of at least 1.5 tiles per
// SM: with long K rows (K = 14336, 2.4 tiles per SM) it was faster than tile
// 8 on the H200, while at K <= 7168 and one token tile 8 was as fast or
// faster (docs/performance.md).
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
// per SM: at 16 tokens on the H200 as fast as or faster than 3 stages (3
// blocks per SM); 256 columns (16 consumer warps), 5-6 stages, two boxes a
// stage and 64 columns were no faster (docs/performance.md). The launches it
// takes: at least 6 tiles per SM (upper bound; two resident grids of the
// 3-stage shape). Below, at one token, the block-per-tile skinny kernel was
// faster (docs/performance.md).
constexpr int kTmaConsumers = 8, kTmaStages = 4, kTmaBoxes = 1;
constexpr int64_t kTmaMinPerSm = 6;

}  // namespace
}  // namespace jax_moe
