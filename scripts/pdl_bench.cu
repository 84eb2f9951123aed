// Experiment: how much of a decode layer's GEMM pair is launch ramp that
// programmatic dependent launch (PDL, sm_90) could hide. With PDL the down
// GEMM is launched while the gate/up GEMM runs: its blocks wait
// (griddepcontrol.wait) only where they first need the gate/up GEMM to be
// done, so the launch, the tile schedule and optionally an L2 prefetch of the
// block's weights overlap the gate/up GEMM's tail.
//
// Variants, each timed over 20 pairs (median of 9 repeats), routings rotated
// over 16 random draws, the down output checked bit for bit against the
// plain pair:
//   plain         the shipped launches, one after the other
//   pdl-start     the down GEMM waits first thing
//   pdl-schedule  it waits after its tile schedule
//   pdl-prefetch  it also asks L2 for its weight slice before waiting
// The gate/up GEMM triggers its dependents as it starts (a trigger only lets
// them launch; their wait still waits for its whole grid and its writes).
// The down GEMM reads a separate activation buffer, so the pair's bytes are
// the layer's; the wait keeps the ordering a real layer would need. Then the
// same under CUDA graphs built as XLA's command buffers build them (each
// custom call captured into a child graph, chained): the two GEMMs as two
// calls (today), as one call, and as one call with PDL (a programmatic edge
// survives stream capture within a call, not across child graphs).
//
// Answer (runs 11.1 and 11.4, H200, 2026-11-30): PDL (waiting after the
// schedule) saves 1.9-3.3 us a pair on plain streams and 1.3-2.3 us under
// graphs: Qwen3-30B-A3B T = 1 27.8 -> 26.1 us, Qwen3-235B-A22B 84.8 -> 82.9,
// DeepSeek-V3 185.7 -> 183.4. The L2 prefetch costs more than it saves.
// From the repository root:
//   nvcc -O3 -std=c++20 -arch=sm_90a -diag-suppress 940,2473 -I csrc \
//     -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//     scripts/pdl_bench.cu -o /tmp/pdl_bench && /tmp/pdl_bench
#include "../csrc/cuda/group_gemm.cu"
#include "bench_util.cuh"
#include "group_gemm_bench.cuh"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

namespace jax_moe {
namespace {

// PdlTrigger / PdlWait: csrc/cuda/cuda_common.cuh.

enum Wait { kNoPdl = 0, kAtStart = 1, kAfterSchedule = 2, kAfterPrefetch = 3 };

// Asks L2 for rows [n0, n0 + 32) of expert `e`'s weights (the block's slice).
__device__ __forceinline__ void PrefetchSlice(const uint16_t* w, int64_t e, int64_t n0, int64_t n,
                                              int64_t k) {
  const int64_t rows = Min64(kSBN, n - n0), lines_per_row = CeilDiv(k * 2, 128);
  const char* base = reinterpret_cast<const char*>(w + (e * n + n0) * k);
  for (int64_t i = threadIdx.x; i < rows * lines_per_row; i += kThreads) {
    const int64_t r = i / lines_per_row, l = i % lines_per_row;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(base + r * k * 2 + l * 128));
  }
}

// The shipped 8-row kernels with PDL hooks: `Trigger` (the first GEMM) lets
// the next launch start; W says where the second GEMM waits. Blocks that only
// zero the tail rows of `out` never wait: the first GEMM does not touch the
// second's output (a library version would wait before any write).
// What both forms do before their tile loop, and for each tile.
template <int W, bool Trigger>
__device__ __forceinline__ void PdlStart() {
  if (Trigger) PdlTrigger();
  if (W == kAtStart) PdlWait();
}
template <typename T, int W, int KT>
__device__ __forceinline__ void PdlTile(const uint16_t* x, const uint16_t* w, uint16_t* out,
                                        const GemmArgs& a, const Tile& tile, int64_t n0) {
  if (W == kAfterPrefetch) PrefetchSlice(w, tile.expert, n0, a.n, a.k);
  if (W >= kAfterSchedule) PdlWait();
  SkinnyTile<T, KT>(x, w, out, tile, a.src, n0, a.n, a.k, [] {});
}

template <typename T, int W, bool Trigger>
__global__ void __launch_bounds__(kThreads, 3)
    SkinnyBlockPdl(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                   const int32_t* __restrict__ sizes, uint16_t* __restrict__ out, GemmArgs a) {
  PdlStart<W, Trigger>();
  ForEachTile<kSR, kSBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    PdlTile<T, W, 2>(x, w, out, a, tile, n0);
  });
}

template <typename T, int W, bool Trigger>
__global__ void __launch_bounds__(kThreads, 4)
    SkinnyPersistentPdl(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                        const int32_t* __restrict__ sizes, uint16_t* __restrict__ out,
                        GemmArgs a) {
  PdlStart<W, Trigger>();
  ForEachTilePersistent<kSR, kSBN>(a, sizes, out, [&](const Tile& tile, int64_t n0) {
    PdlTile<T, W, 1>(x, w, out, a, tile, n0);
  });
}

// A stream of its own: PDL is not for the legacy default stream.
cudaStream_t Stream() {
  static cudaStream_t s = [] {
    cudaStream_t t;
    CK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    return t;
  }();
  return s;
}

// The shipped tile-8 dispatch (LaunchGroupGemm's case 8) with the PDL kernels;
// `pdl` launches with programmatic stream serialisation.
template <int W, bool Trigger>
void Launch8(const uint16_t* x, const uint16_t* w, const int32_t* sizes, uint16_t* out, int64_t m,
             int64_t n, int64_t k, int64_t groups, bool pdl) {
  using T = __nv_bfloat16;
  GemmArgs a = DenseArgs(m, n, k);
  const unsigned grid = Schedule(a, groups, kSR, kSBN);
  // The shipped choice of form (from the shipped kernels' occupancy), then
  // this variant's own resident grid.
  const int resident = ResidentBlocks<GroupGemmSkinnyPersistentKernel<T>>(kThreads);
  const bool persistent =
      resident > 0 && PersistScheduleFits(groups, m) &&
      (a.total_blocks >= kPersistWaves * resident ||
       SkinnyPersistentWins(a, groups, ResidentBlocks<GroupGemmSkinnyKernel<T>>(kThreads),
                            resident));
  const int own_resident = ResidentBlocks<SkinnyPersistentPdl<T, W, Trigger>>(kThreads);
  if (persistent)
    CK(LaunchKernel(SkinnyPersistentPdl<T, W, Trigger>,
                    static_cast<unsigned>(own_resident > 0 ? own_resident : 1), kThreads, 0,
                    Stream(), pdl, x, w, sizes, out, a));
  else
    CK(LaunchKernel(SkinnyBlockPdl<T, W, Trigger>, grid, kThreads, 0, Stream(), pdl, x, w, sizes,
                    out, a));
}

// Times `calls` units as XLA's command buffers run custom calls: each unit
// (one custom call) is stream-captured into a graph of its own and added as a
// child-graph node after the previous unit's node; the chain is one graph
// launch. unit(c, part) launches part `part` (0 .. parts - 1) of call c; with
// parts > 1 each part is a separate custom call (its own child graph).
template <typename F>
double GraphMicros(F&& unit, int parts, int calls, int reps) {
  cudaGraph_t parent;
  CK(cudaGraphCreate(&parent, 0));
  cudaGraphNode_t prev{};
  bool have_prev = false;
  for (int c = 0; c < calls; ++c) {
    for (int part = 0; part < parts; ++part) {
      cudaGraph_t child;
      CK(cudaStreamBeginCapture(Stream(), cudaStreamCaptureModeThreadLocal));
      unit(c, part);
      CK(cudaStreamEndCapture(Stream(), &child));
      cudaGraphNode_t node;
      CK(cudaGraphAddChildGraphNode(&node, parent, have_prev ? &prev : nullptr,
                                    have_prev ? 1 : 0, child));
      CK(cudaGraphDestroy(child));
      prev = node;
      have_prev = true;
    }
  }
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, parent, 0));
  CK(cudaGraphLaunch(exec, Stream()));  // warm-up
  CK(cudaStreamSynchronize(Stream()));
  const double us =
      MedianLaunchMicros([&](int) { CK(cudaGraphLaunch(exec, Stream())); }, 1, reps, Stream()) /
      calls;
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(parent));
  return us;
}

}  // namespace
}  // namespace jax_moe

using namespace jax_moe;

int main() {
  const Layer layers[] = {
      LayerOf("q30 T1", kQwen3_30B, 1), LayerOf("q30 T4", kQwen3_30B, 4),
      LayerOf("q235 T1", kQwen3_235B, 1), LayerOf("ds T1", kDeepSeekV3, 1),
  };
  const int kRot = 16, kCalls = 20, kReps = 9;
  for (const Layer& L : layers) {
    const PairBuffers b(L, kRot);
    const int64_t m = b.m, n1 = b.n1, k1 = b.k1, n2 = b.n2, k2 = b.k2, w1n = b.w1n, w2n = b.w2n;
    uint16_t *w1 = b.w1, *w2 = b.w2, *x = b.x, *h = b.h, *act = b.act, *y = b.y;
    int32_t* sizes = b.sizes;
    // Values hashed from the index (repeating every 2^20 elements, which no
    // expert's size is a multiple of), so a wrong row or expert shows.
    {
      std::vector<uint16_t> hv(std::max<int64_t>(m * k2, 1 << 20));
      for (size_t i = 0; i < hv.size(); ++i) {
        const float v = ((i * 2654435761u) >> 20 & 1023) / 1024.f - 0.5f;
        hv[i] = __bfloat16_as_ushort(__float2bfloat16(v));
      }
      CK(cudaMemcpy(act, hv.data(), m * k2 * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(x, hv.data(), std::min<int64_t>(m * k1, hv.size()) * 2,
                    cudaMemcpyHostToDevice));
      for (int64_t o = 0; o < w2n; o += hv.size())
        CK(cudaMemcpy(w2 + o, hv.data(), std::min<int64_t>(hv.size(), w2n - o) * 2,
                      cudaMemcpyHostToDevice));
      CK(cudaMemset(w1, 0x3c, w1n * 2));
    }
    double active = 0;
    const std::vector<int32_t> hs = RandomExpertSizes(L.E, L.T, L.topk, kRot, &active);
    CK(cudaMemcpy(sizes, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    const double mb = active * (n1 * k1 + n2 * k2) * 2 / 1e6;
    printf("%s: active %.1f, %.1f MB of weights per pair\n", L.name, active, mb);

    auto s_of = [&](int c) { return sizes + (c % kRot) * L.E; };
    using PairFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*,
                            const uint16_t*, uint16_t*, const int32_t*, const Layer&);
    struct Variant {
      const char* name;
      PairFn fn;
    };
    // g1: x @ w1 -> h (triggers its dependents); g2: act @ w2 -> y.
#define PAIR(W, PDL)                                                                          \
  [](const uint16_t* x, const uint16_t* w1, const uint16_t* w2, uint16_t* h,                  \
     const uint16_t* act, uint16_t* y, const int32_t* s, const Layer& L) {                     \
    const int64_t m = static_cast<int64_t>(L.T) * L.topk;                                     \
    Launch8<kNoPdl, PDL>(x, w1, s, h, m, 2 * L.I, L.H, L.E, false);                           \
    Launch8<W, false>(act, w2, s, y, m, L.H, L.I, L.E, PDL);                                  \
  }
    const Variant variants[] = {
        {"plain", PAIR(kNoPdl, false)},
        {"pdl-start", PAIR(kAtStart, true)},
        {"pdl-schedule", PAIR(kAfterSchedule, true)},
        {"pdl-prefetch", PAIR(kAfterPrefetch, true)},
    };
#undef PAIR
    std::vector<uint16_t> want(m * n2), got(m * n2);
    for (const Variant& v : variants) {
      CK(cudaMemset(y, 0xff, m * n2 * 2));
      CK(cudaDeviceSynchronize());  // the memset ran on the default stream
      v.fn(x, w1, w2, h, act, y, s_of(0), L);
      CK(cudaStreamSynchronize(Stream()));
      CK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
      if (&v == &variants[0]) want = got;
      const bool same = std::memcmp(want.data(), got.data(), want.size() * 2) == 0;
      const double us = MedianLaunchMicros(
          [&](int c) { v.fn(x, w1, w2, h, act, y, s_of(c), L); }, kCalls, kReps, Stream());
      printf("  %-14s %7.1f us  %.2f TB/s  %s\n", v.name, us, mb / us,
             same ? "same bits as plain" : "DIFFERENT from plain");
    }
    // Under CUDA graphs as XLA builds them: today's two custom calls, the
    // pair as one custom call, and the pair as one call with PDL.
    auto g1 = [&](int c) { Launch8<kNoPdl, true>(x, w1, s_of(c), h, m, n1, k1, L.E, false); };
    const double two = GraphMicros(
        [&](int c, int part) {
          if (part == 0)
            Launch8<kNoPdl, false>(x, w1, s_of(c), h, m, n1, k1, L.E, false);
          else
            Launch8<kNoPdl, false>(act, w2, s_of(c), y, m, n2, k2, L.E, false);
        },
        2, kCalls, kReps);
    const double one = GraphMicros(
        [&](int c, int) {
          Launch8<kNoPdl, false>(x, w1, s_of(c), h, m, n1, k1, L.E, false);
          Launch8<kNoPdl, false>(act, w2, s_of(c), y, m, n2, k2, L.E, false);
        },
        1, kCalls, kReps);
    const double one_pdl = GraphMicros(
        [&](int c, int) {
          g1(c);
          Launch8<kAfterSchedule, false>(act, w2, s_of(c), y, m, n2, k2, L.E, true);
        },
        1, kCalls, kReps);
    printf("  graphs: two calls %.1f us, one call %.1f us, one call with PDL %.1f us\n", two, one,
           one_pdl);
  }
  return 0;
}
