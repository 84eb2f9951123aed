// The grouped GEMM's own Hopper kernel: TMA, wgmma, warp-specialised and
// persistent, without CUTLASS. What it does that the CUTLASS ptr-array kernel
// (gemm_sm90a.cu) cannot: an expert's last 128-row tile with at most 64 rows
// left runs on one consumer warpgroup (the weight tile is still read once for
// the pair of 64-row halves), so the rows computed past each expert's end
// are at most 63 instead of 127; and a gather reads the token rows itself
// (no expanded copy of x).
//
//  * Tiles of 128 rows x 256 columns, 64 k a stage, 4 stages of 48 KB. One
//    producer warpgroup: thread 0 loads each stage's weight tile (w[e] rows
//    n0..n0+255, a 3-D tensor map (k, n, e): zero past n and k) and, without
//    a gather, the two 64-row halves of x (2-D map: zero past m and k); with
//    a gather, the four producer warps copy the tile's rows with cp.async,
//    4 whole rows a warp instruction (zero past the expert's rows, for an
//    invalid entry and past k), 128-byte swizzled as the TMA would have, and
//    each thread's copies arrive on the stage's barrier as they land.
//  * Two consumer warpgroups, rows 0-63 and 64-127: per stage four
//    m64n256k16 wgmma on the shared weight tile; a warpgroup whose 64 rows
//    are all past the expert's end only frees the stages. Stages are freed
//    one step behind (wgmma.wait_group 1), or with the deferred activation
//    (3 stages) as soon as their wgmma is done. Each output is summed over
//    all of k by one warpgroup in k order: bitwise reproducible run to run.
//  * The schedule: every CTA scans expert_sizes into shared memory
//    (ScanSchedule); tiles are numbered expert by expert, an expert's
//    m-slots fastest (as CUTLASS's grouped scheduler along M). Each CTA takes its first tile by its index and
//    the next ones from a device counter (each tile goes to the first CTA
//    free, so the CTAs sharing a weight tile start it together even when
//    the one-warpgroup tiles finish early), or with no counter by a static
//    stride. Producer thread 0 hands each tile id to the consumers through
//    a 2-slot ring. The consumers then zero the tail rows [P_E, m).
//  * The epilogue goes through shared memory, 64 columns at a time, and
//    stores 16 bytes a thread along the rows, predicated on the expert's rows
//    and n. With an activation it multiplies 128 gate by the matching 128 up
//    columns of w and stores act(g) * u (out has n / 2 columns); up to
//    kDeferMaxK the warpgroup only parks g and u in shared memory and works
//    the activation off a chunk a k step during its next tile, so the tensor
//    cores do not wait for it.
#include "kernels/cuda/group_gemm/wgmma_sm90a.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/gemm_dims.h"
#include "kernels/common/numeric.h"
#include "kernels/common/wgmma_rule.h"
#include "kernels/cuda/act_math.cuh"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/group_gemm/schedule.cuh"
#include "kernels/cuda/group_gemm/tensor_map.cuh"

namespace jax_moe {
namespace {

constexpr int kWgBM = 128;                // rows a tile: two warpgroups of 64
constexpr int kWgBN = 256;                // columns a tile
constexpr int kWgBK = 64;                 // k a stage: one 128-byte swizzle row
constexpr int kWgStages = 4;
constexpr int kWgThreads = 384;           // producer warpgroup + 2 consumer warpgroups
constexpr int kWgAHalf = 64 * 128;        // bytes of 64 rows x 64 k (16-bit)
constexpr int kWgABytes = 2 * kWgAHalf;
constexpr int kWgBBytes = kWgBN * 128;
constexpr int kWgStageBytes = kWgABytes + kWgBBytes;
constexpr int kOutPitch = 144;  // bytes a row of the epilogue's 64-column staging
// The deferred activation (kDefer): a consumer warpgroup parks its finished
// tile's gate and up columns (rounded to DT) in shared memory and works the
// activation off during its next tile's main loop: 64 rows of 256 columns +
// 16 bytes of pad. That staging leaves room for 3 stages, which costs more
// than the hidden epilogue saves where K is large (the main loop's share
// grows with K): up to kDeferMaxK the activation is deferred, above it
// applied in the epilogue with 4 stages (benchmarks/kernels/wgmma_gemm_bench.cu:
// K = 2048 and 4096 faster deferred, 7168 slower; docs/performance.md).
constexpr int kStgPitch = 528;
constexpr int kStgBytes = 64 * kStgPitch;
constexpr int kActChunks = 64 * 128 / 8 / 128;  // 8 output columns a chunk, a thread's chunks a tile
constexpr int64_t kDeferMaxK = 4096;
template <bool kDefer>
constexpr int WgStages() {
  return kDefer ? 3 : kWgStages;
}
template <bool kDefer>
constexpr int WgSmem() {  // + alignment slack (128B swizzle)
  return WgStages<kDefer>() * kWgStageBytes + 1024 + (kDefer ? 2 * kStgBytes : 0);
}

// The 128 f32 accumulator registers of one m64n256 wgmma, as asm text and as operands.
#define JAX_MOE_WGMMA_D128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define JAX_MOE_WGMMA_OPS128(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// A K-major operand in shared memory, 128-byte swizzled (rows of 64 16-bit
// elements, 8-row atoms 1024 bytes apart): the wgmma matrix descriptor.
__device__ __forceinline__ uint64_t WgmmaDesc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// d (+)= A (64 x 16, desc_a) * B^T (256 x 16, desc_b); accumulate 0 zeroes d first.
template <DType DT>
__device__ __forceinline__ void Wgmma64x256(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                            int accumulate) {
  if constexpr (DT == DType::BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" JAX_MOE_WGMMA_D128
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : JAX_MOE_WGMMA_OPS128(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" JAX_MOE_WGMMA_D128
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : JAX_MOE_WGMMA_OPS128(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait(float (&d)[128]) {
  asm volatile("wgmma.wait_group.sync.aligned %128;\n" : JAX_MOE_WGMMA_OPS128(d) : "n"(N)
               : "memory");
}

template <DType DT>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (DT == DType::BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// kAct < 0: out = the product. kAct an Activation: the gated activation in
// the epilogue (kDefer: worked off during the next tile's main loop), out
// (m, n / 2) = act(g) * u with g, u the product's columns c and n / 2 + c
// rounded to DT (the bits of the GEMM then the activation kernel); each tile
// then multiplies 128 gate and the same 128 up rows of w.
template <DType DT, bool kGather, int kAct, bool kDefer>
__global__ void __launch_bounds__(kWgThreads, 1)
    GroupGemmWgmmaKernel(const __grid_constant__ CUtensorMap amap,
                         const __grid_constant__ CUtensorMap bmap, const uint16_t* __restrict__ x,
                         const int32_t* __restrict__ sizes, uint16_t* __restrict__ out,
                         GemmArgs a, int* __restrict__ counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kCols = kAct >= 0 ? kWgBN / 2 : kWgBN;  // columns of out a tile
  static_assert(!kDefer || kAct >= 0, "only the activation is deferred");
  constexpr int kStages = WgStages<kDefer>();
  extern __shared__ unsigned char smem_raw[];
  unsigned char* ring = smem_raw + ((1024 - (SmemAddr(smem_raw) & 1023)) & 1023);
  __shared__ uint64_t full[kWgStages], empty[kWgStages];
  __shared__ uint64_t tile_full[2], tile_empty[2];  // the tile-id ring, producer -> consumers
  __shared__ int64_t s_tile[2];
  __shared__ int32_t s_src[kWgBM];  // with a gather: the token row of each row of the tile, or -1
  __shared__ int32_t s_tinfo[3];     // the producer's tile: expert, n0, row0
  __shared__ PersistSchedule sch;
  __shared__ int64_t s_sums[kWgThreads / 32];
  // The plain epilogue's staging (the activation's is in the dynamic ring's tail).
  __shared__ __align__(16) unsigned char s_out[2][kDefer ? 16 : 64 * kOutPitch];
  PdlStart(a);
  ScanSchedule<kWgBM, kWgThreads / 32>(a, sizes, sch, s_sums);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], kGather ? 1 + 128 : 1);  // expect_tx (+ each producer thread's copies)
      MbarInit(&empty[s], 8);                    // each consumer warp
    }
    for (int s = 0; s < 2; ++s) {
      MbarInit(&tile_full[s], 1);
      MbarInit(&tile_empty[s], 8);
    }
    FenceMbarInit();
  }
  __syncthreads();
  // The warpgroup through a shuffle: the compiler then knows it is warp-uniform
  // (a wgmma under a branch it cannot prove uniform is serialised).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int tid = threadIdx.x & 127;
  const int num_e = static_cast<int>(a.num_experts);
  const int64_t real = sch.tiles * a.ntiles;
  const int ksteps = static_cast<int>(CeilDiv(a.k, kWgBK));
  int stage = 0;
  unsigned phase = 0;
  auto advance = [&] {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  };
  // Tile id -> (m-slot, column tile), expert by expert and, within an
  // expert, its m-slots fastest: the m-slots that share a weight tile are
  // consecutive ids (expert e's tiles start at id tile0[e] * ntiles).
  auto tile_of = [&](int64_t id, int* n0) {
    const int64_t key = id / a.ntiles;  // tile0[e] * ntiles <= id  <=>  tile0[e] <= key
    int lo = 0, hi = num_e - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (sch.tile0[mid] <= key) lo = mid;
      else hi = mid - 1;
    }
    const int64_t first = sch.tile0[lo], slots = sch.tile0[lo + 1] - first;
    const int64_t local = id - first * a.ntiles;
    *n0 = static_cast<int>(local / slots * kCols);
    return PersistTile<kWgBM>(sch, num_e, first + local % slots);
  };

  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    PdlWait();  // x may be the previous kernel's output
    if (!kGather && tid != 0) return;
    // Gather: each warp copies 32 rows of the tile, 4 whole 128-byte rows an
    // instruction (lane l: row 4 i + l / 8 of the warp's, 16-byte chunk
    // l % 8; a copy a lane per row would touch 32 lines an instruction),
    // 128-byte swizzled (chunk c of row r at chunk c ^ (r % 8)), the halves
    // 8 KB apart. Each thread's copies arrive on the stage's barrier as they
    // land (cp.async.mbarrier.arrive.noinc), so no thread waits for its
    // copies and the weight tiles stream ahead as far as the ring allows.
    // The producer has 40 registers: the row indices and the tile's fields
    // are read back from shared memory each step rather than held.
    const int chunk = tid & 7, lrow = 32 * (tid >> 5) + ((tid & 31) >> 3);  // row 4 i + lrow
    for (int it = 0;; ++it) {
      // The next tile: this CTA's first, then one from the counter, or with
      // none a static stride. Thread 0 hands it to the consumers (ring of 2)
      // and, with a gather, to the other producer threads.
      const int slot = it & 1;
      if (tid == 0) {
        MbarWait(&tile_empty[slot], ((it >> 1) & 1) ^ 1u);
        s_tile[slot] = it == 0 ? blockIdx.x
                       : counter != nullptr
                           ? gridDim.x + static_cast<int64_t>(atomicAdd(counter, 1))
                           : blockIdx.x + static_cast<int64_t>(it) * gridDim.x;
        MbarArrive(&tile_full[slot]);
      }
      if constexpr (kGather) asm volatile("bar.sync 3, 128;\n" ::: "memory");
      const int64_t id = s_tile[slot];
      if (id >= real) break;
      int n0;
      const Tile tile = tile_of(id, &n0);
      const bool half = tile.row_lim - tile.row0 <= 64;
      if (tid == 0) {
        s_tinfo[0] = static_cast<int>(tile.expert);
        s_tinfo[1] = n0;
        s_tinfo[2] = static_cast<int>(tile.row0);
      }
      if constexpr (kGather) {  // the tile's token rows (every thread is past the last tile's)
        const int64_t r = tile.row0 + tid;
        s_src[tid] = r < tile.row_lim ? static_cast<int32_t>(a.src.Row(r)) : -1;
        asm volatile("bar.sync 3, 128;\n" ::: "memory");
      }
      const bool copies = !(half && tid >= 64);  // warps 2 and 3 hold rows 64-127
      for (int ks = 0; ks < ksteps; ++ks) {
        const int k0 = ks * kWgBK;
        MbarWait(&empty[stage], phase ^ 1u);  // the first round passes: the ring starts empty
        unsigned char* st = ring + stage * kWgStageBytes;
        if (tid == 0) {
          int e, n0, row0;
          asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n"
                       : "=r"(e), "=r"(n0) : "r"(SmemAddr(&s_tinfo[0])));
          asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(row0) : "r"(SmemAddr(&s_tinfo[2])));
          MbarArriveExpectTx(&full[stage],
                             kWgBBytes + (kGather ? 0 : (half ? kWgAHalf : kWgABytes)));
          if constexpr (kAct >= 0) {  // w as (k, n / 2, 2, e): gate rows, then their up rows
            TmaLoad4D(st + kWgABytes, &bmap, k0, n0, 0, e, &full[stage]);
            TmaLoad4D(st + kWgABytes + kWgBBytes / 2, &bmap, k0, n0, 1, e, &full[stage]);
          } else {
            TmaLoad3D(st + kWgABytes, &bmap, k0, n0, e, &full[stage]);
          }
          if (!kGather) {
            TmaLoad2D(st, &amap, k0, row0, &full[stage]);
            if (!half) TmaLoad2D(st + kWgAHalf, &amap, k0, row0 + 64, &full[stage]);
          }
        }
        if (kGather) {
          if (copies) {
            const int kc = k0 + 8 * chunk;  // k % 8 == 0: whole chunks
            int32_t xrs[8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
              asm volatile("ld.shared.s32 %0, [%1];\n"
                           : "=r"(xrs[i]) : "r"(SmemAddr(&s_src[lrow + 4 * i])));
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const int r = lrow + 4 * i;
              const bool in = xrs[i] >= 0 && kc < a.k;
              CpAsync16Zfill(st + (r >> 6) * kWgAHalf + (r & 63) * 128 + ((chunk ^ (r & 7)) << 4),
                             in ? x + static_cast<int64_t>(xrs[i]) * a.k + kc : x, in ? 16 : 0);
            }
          }
          CpAsyncArriveNoinc(&full[stage]);  // every thread, with or without copies
        }
        advance();
      }
    }
    if constexpr (kGather) CpAsyncWait<0>();
    return;
  }

  // Consumers: warpgroup cw takes rows 64 cw .. 64 cw + 63 of each tile.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1, warp = tid >> 5, lane = tid & 31;
  const uint32_t ring_addr = SmemAddr(ring);
  auto release = [&](int st) {  // one arrival a warp, once all its lanes are done with st
    __syncwarp();
    if (lane == 0) MbarArrive(&empty[st]);
  };
  // d[4j + q]: row 16 warp + lane / 4 (+ 8 for q >= 2), column 8 j + 2 (lane % 4) + q % 2.
  const int rr = 16 * warp + (lane >> 2), cc = 4 * (lane & 3);
  // With the activation: the staged tile whose outputs are still owed (rows
  // p_row0.. of the warpgroup, below p_lim; columns p_n0..), and how many of
  // this thread's chunks of it are done. A chunk: one row's 8 gate and 8 up
  // columns in, act(g) * u's 8 columns (16 bytes) out.
  unsigned char* stg = ring + kStages * kWgStageBytes + cw * kStgBytes;
  int64_t p_row0 = 0, p_lim = 0;
  int p_n0 = 0, p_done = kActChunks;
  auto act_chunk = [&] {
    const int id = tid + 128 * p_done++, row = id >> 4, c8 = id & 15;
    const int64_t r = p_row0 + row, c = p_n0 + 8 * c8;
    if (r >= p_lim || c >= a.n) return;  // n % 8 == 0: the whole 16 bytes
    float g[8], u[8];
    Unpack<DT>(*reinterpret_cast<const uint4*>(stg + row * kStgPitch + 16 * c8), g);
    Unpack<DT>(*reinterpret_cast<const uint4*>(stg + row * kStgPitch + 256 + 16 * c8), u);
    uint4 v;
    v.x = PackPair<DT>(Act<kAct>(g[0]) * u[0], Act<kAct>(g[1]) * u[1]);
    v.y = PackPair<DT>(Act<kAct>(g[2]) * u[2], Act<kAct>(g[3]) * u[3]);
    v.z = PackPair<DT>(Act<kAct>(g[4]) * u[4], Act<kAct>(g[5]) * u[5]);
    v.w = PackPair<DT>(Act<kAct>(g[6]) * u[6], Act<kAct>(g[7]) * u[7]);
    *reinterpret_cast<uint4*>(out + r * a.n + c) = v;
  };
  for (int it = 0;; ++it) {
    const int slot = it & 1;
    MbarWait(&tile_full[slot], (it >> 1) & 1);
    // Lane 0 reads the id for its warp and frees the slot: the read and the
    // arrival in one thread order the producer's next write after it.
    int64_t id = 0;
    if (lane == 0) {
      id = s_tile[slot];
      MbarArrive(&tile_empty[slot]);
    }
    id = __shfl_sync(0xffffffffu, id, 0);
    if (id >= real) break;
    int n0;
    const Tile tile = tile_of(id, &n0);
    const bool active = cw == 0 || tile.row_lim - tile.row0 > 64;
    float d[128];
    int prev = 0;
    for (int ks = 0; ks < ksteps; ++ks) {
      MbarWait(&full[stage], phase);
      // The gathered rows were written through the generic proxy, wgmma
      // reads through the async proxy.
      if constexpr (kGather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if (active) {
        const uint32_t sa = ring_addr + stage * kWgStageBytes + cw * kWgAHalf;
        const uint32_t sb = ring_addr + stage * kWgStageBytes + kWgABytes;
        const uint64_t da = WgmmaDesc(sa), db = WgmmaDesc(sb);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // 16 k = 32 bytes along the swizzled row
          Wgmma64x256<DT>(d, da + 2 * kk, db + 2 * kk, (ks > 0 || kk > 0) ? 1 : 0);
        WgmmaCommit();
      }
      // The previous tile's activation, a chunk a step, while the tensor cores run.
      if constexpr (kDefer) {
        if (p_done < kActChunks) act_chunk();
      }
      // With 3 stages (kDefer) a stage is freed as soon as its wgmma is
      // done: the weights stream from DRAM, and a stage held one step longer
      // would leave 2 of the 3 loading. With 4, one step behind (freeing at
      // once measured no faster there).
      if (active) {
        if constexpr (kDefer) {
          WgmmaWait<0>(d);
          release(stage);
        } else {
          WgmmaWait<1>(d);
          if (ks > 0) release(prev);
        }
      } else {
        release(stage);
      }
      prev = stage;
      advance();
    }
    if (!active) continue;
    if constexpr (!kDefer) {
      WgmmaWait<0>(d);
      release(prev);
    }
    const int64_t wrow0 = tile.row0 + 64 * cw;
    if constexpr (kDefer) {
      // Finish the staged tile, then park this one's gate and up columns
      // rounded to DT (the bits the GEMM then the activation kernel see):
      // rows 528 bytes apart, so a warp's pair writes hit 32 banks.
      while (p_done < kActChunks) act_chunk();
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<uint32_t*>(stg + rr * kStgPitch + 16 * j + cc) =
            PackPair<DT>(d[4 * j], d[4 * j + 1]);
        *reinterpret_cast<uint32_t*>(stg + (rr + 8) * kStgPitch + 16 * j + cc) =
            PackPair<DT>(d[4 * j + 2], d[4 * j + 3]);
      }
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
      p_row0 = wrow0;
      p_lim = tile.row_lim;
      p_n0 = n0;
      p_done = 0;
    } else {
      // Through shared memory, 64 columns at a time: the warpgroup's 64 rows
      // of them (rows 144 bytes apart: the pair writes hit 32 banks), then
      // 16-byte stores along each row.
      // pair(j, h): out's columns 8 j + 2 (lane % 4) and the next of that row (+ 8 h).
      auto pair = [&](int j, int h) -> uint32_t {
        const int q = 4 * j + 2 * h;
        if constexpr (kAct >= 0) {  // j < 16: d[q] the gate of column c, d[q + 64] its up
          return PackPair<DT>(Act<kAct>(Round<DT>(d[q])) * Round<DT>(d[q + 64]),
                              Act<kAct>(Round<DT>(d[q + 1])) * Round<DT>(d[q + 65]));
        } else {
          return PackPair<DT>(d[q], d[q + 1]);
        }
      };
      unsigned char* buf = s_out[cw];
#pragma unroll
      for (int ch = 0; ch < kCols / 64; ++ch) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          *reinterpret_cast<uint32_t*>(buf + rr * kOutPitch + 16 * jj + cc) = pair(8 * ch + jj, 0);
          *reinterpret_cast<uint32_t*>(buf + (rr + 8) * kOutPitch + 16 * jj + cc) =
              pair(8 * ch + jj, 1);
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int id = tid + 128 * i, row = id >> 3, c16 = id & 7;
          const int64_t r = wrow0 + row, c = n0 + 64 * ch + 8 * c16;
          if (r < tile.row_lim && c < a.n)  // n % 8 == 0: the whole 16 bytes
            *reinterpret_cast<uint4*>(out + r * a.n + c) =
                *reinterpret_cast<const uint4*>(buf + row * kOutPitch + 16 * c16);
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
      }
    }
  }
  if constexpr (kDefer) {
    while (p_done < kActChunks) act_chunk();
  }
  // Rows [P_E, m): zero. A CTA without real tiles never waited for the
  // previous kernel, which may still read out.
  PdlWait();
  const int64_t total = real + CeilDiv(a.m - sch.rows, kWgBM) * a.ntiles;
  for (int64_t id = real + blockIdx.x; id < total; id += gridDim.x)
    ZeroTailChunk<kWgBM, kCols>(out, a, sch.rows, id - real, threadIdx.x - 128, 256);
#endif
}

template <DType DT, bool kGather, int kAct, bool kDefer = false>
cudaError_t LaunchWgmma(const WgmmaGemmCall& c, bool* ran) {
  constexpr auto kernel = GroupGemmWgmmaKernel<DT, kGather, kAct, kDefer>;
  constexpr int kCols = kAct >= 0 ? kWgBN / 2 : kWgBN;
  const cudaError_t attr = EnsureDynamicSmem<kernel>(WgSmem<kDefer>());
  if (attr != cudaSuccess) {
    cudaGetLastError();
    return cudaSuccess;  // the kernel does not load here: fall back
  }
  const int sms = DeviceSms();
  const TensorMapEncodeFn encode = TensorMapEncode();
  if (sms <= 0 || encode == nullptr) return cudaSuccess;
  const int64_t n_out = kAct >= 0 ? c.n / 2 : c.n;
  // w as (k, n, e) in boxes of 64 k x 256 rows; gated, as (k, n / 2, 2, e) in
  // boxes of 64 k x 128 rows (gate or up). x as (k, rows), boxes of 64 k x 64 rows.
  CUtensorMap bmap, amap;
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(c.k) * 2;
  CUresult res;
  if constexpr (kAct >= 0) {
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(c.k), static_cast<cuuint64_t>(n_out), 2,
                                static_cast<cuuint64_t>(c.groups)};
    const cuuint64_t strides[3] = {row_bytes, row_bytes * n_out, row_bytes * c.n};
    const cuuint32_t box[4] = {kWgBK, kCols, 1, 1};
    res = encode(&bmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(c.w), dims, strides,
                 box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(c.k), static_cast<cuuint64_t>(c.n),
                                static_cast<cuuint64_t>(c.groups)};
    const cuuint64_t strides[2] = {row_bytes, row_bytes * c.n};
    const cuuint32_t box[3] = {kWgBK, kCols, 1};
    res = encode(&bmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(c.w), dims, strides,
                 box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  if (res != CUDA_SUCCESS) return cudaSuccess;
  const int64_t a_rows = kGather ? c.x_rows : c.m;
  const cuuint64_t adims[2] = {static_cast<cuuint64_t>(c.k), static_cast<cuuint64_t>(a_rows)};
  const cuuint64_t astrides[1] = {row_bytes};
  const cuuint32_t abox[2] = {kWgBK, 64};
  if (encode(&amap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(c.x), adims, astrides,
             abox, ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return cudaSuccess;
  GemmArgs a{};
  a.m = c.m;
  a.n = n_out;
  a.k = c.k;
  a.num_experts = c.groups;
  a.ntiles = (n_out + kCols - 1) / kCols;
  a.wait_first = c.pdl && c.wait_first;
  a.src = RowSource{c.rows, c.topk, c.x_rows * c.topk};
  const int grid = c.max_ctas > 0 && c.max_ctas < sms ? c.max_ctas : sms;
  if (c.counter != nullptr && !c.counter_zeroed) {
    const cudaError_t err = cudaMemsetAsync(c.counter, 0, sizeof(int), c.stream);
    if (err != cudaSuccess) return err;
  }
  *ran = true;
  return LaunchKernel(kernel, grid, kWgThreads, WgSmem<kDefer>(), c.stream, c.pdl, amap, bmap,
                      static_cast<const uint16_t*>(c.x), c.sizes, static_cast<uint16_t*>(c.out),
                      a, c.counter);
}

// The gated activation deferred to the next tile up to kDeferMaxK, else in the epilogue.
template <DType DT, int kAct>
cudaError_t LaunchWgmmaAct(const WgmmaGemmCall& c, bool* ran) {
  return c.k <= kDeferMaxK ? LaunchWgmma<DT, true, kAct, true>(c, ran)
                           : LaunchWgmma<DT, true, kAct>(c, ran);
}

template <DType DT>
cudaError_t DispatchWgmma(const WgmmaGemmCall& c, bool* ran) {
  if (c.act < 0)
    return c.rows != nullptr ? LaunchWgmma<DT, true, -1>(c, ran)
                             : LaunchWgmma<DT, false, -1>(c, ran);
  switch (c.act) {  // the gated activation: with a gather only (the layer's w13 GEMM)
    case kSilu:
      return LaunchWgmmaAct<DT, kSilu>(c, ran);
    case kGeluExact:
      return LaunchWgmmaAct<DT, kGeluExact>(c, ran);
    case kGeluTanh:
      return LaunchWgmmaAct<DT, kGeluTanh>(c, ran);
    default:
      return cudaSuccess;
  }
}

}  // namespace

static_assert(kWgmmaMaxExperts <= kPersistMaxE, "the schedule's scan holds every expert");

cudaError_t GroupGemmWgmma(const WgmmaGemmCall& c, bool* ran) {
  *ran = false;
  const bool gather = c.rows != nullptr;
  if (!WgmmaShapeOk(c.m, c.n, c.k, c.groups, c.act >= 0) || (c.act >= 0 && !gather) ||
      (gather && (c.x_rows <= 0 || c.x_rows > kInt32Max || c.topk <= 0)) || !Aligned16(c.x) ||
      !Aligned16(c.w) || !Aligned16(c.out) || DeviceMajor() != 9)
    return cudaSuccess;
  return c.bf16 ? DispatchWgmma<DType::BF16>(c, ran) : DispatchWgmma<DType::F16>(c, ran);
}

}  // namespace jax_moe
